"""The default example's tasks in GSM8K's shape, as a Parquet file: a ``question`` column
("3+4") and an ``answer`` column holding a rationale that ends ``#### 7``, under a ``uid``
id column. With ``taskset.prompt_template: "{question}="`` and ``answer_extract: gsm8k``
they are the default example's tasks again (:data:`OVERRIDES`)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.paths import ADDITION

OVERRIDES = (
    "taskset.id_key=uid",
    'taskset.prompt_template="{question}="',  # quoted: a YAML value
    "taskset.answer_extract=gsm8k",
)
"""``-o`` settings that read :func:`write_gsm8k_shaped`'s file as the default example."""


def write_gsm8k_shaped(path: Path) -> Path:
    """Write ``addition.jsonl`` as GSM8K-shaped Parquet rows to ``path``; returns it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for line in ADDITION.read_text().splitlines():
        task = json.loads(line)
        question = task["prompt"].rstrip("=")
        a, b = question.split("+")
        rationale = f"{a} plus {b} makes {task['answer']}.\n#### {task['answer']}"
        rows.append({"uid": task["id"], "question": question, "answer": rationale})
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
    return path


def write_hub_folder(folder: Path) -> Path:
    """``folder`` laid out as the hub's download of GSM8K (``hf download openai/gsm8k
    --repo-type dataset --local-dir folder``): ``main/`` and ``socratic/``, each with
    ``train-00000-of-00001.parquet`` (:func:`write_gsm8k_shaped`'s 100 rows) and
    ``test-00000-of-00001.parquet`` (its first 10), a README and the download's hidden
    ``.cache/``. Returns ``folder``."""
    import pyarrow.parquet as pq

    for config in ("main", "socratic"):
        (folder / config).mkdir(parents=True)
        train = write_gsm8k_shaped(folder / config / "train-00000-of-00001.parquet")
        pq.write_table(pq.read_table(train).slice(0, 10), train.with_name(TEST_FILE))
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: main\n---\n")
    cache = folder / ".cache" / "huggingface" / "download" / "main"
    cache.mkdir(parents=True)
    (cache / "train-00000-of-00001.parquet.metadata").write_text("etag\n")
    return folder


TEST_FILE = "test-00000-of-00001.parquet"
"""The test split's file in each configuration's folder of :func:`write_hub_folder`."""
