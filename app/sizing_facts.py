"""The facts :mod:`app.sizing` sizes by, read from disk and torch: the model folder's size,
context and chat template, a bounded sample of the data's prompts and answers counted in
the model's tokens, and the GPUs there are (or the ones given for another machine)."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec

from streamrft.app.model_shapes import context_of
from streamrft.app.sizing import DataFacts, Hardware, ModelFacts
from streamrft.infra.config import ModelConfig, TasksetConfig
from streamrft.infra.memory_plan import GIB
from streamrft.schemas.errors import ConfigError

SAMPLE_ROWS = 1000
"""Most rows of the data read to size by (the first ones)."""


def model_facts(folder: Path, tokenizer: Any) -> ModelFacts:
    """The model in ``folder`` (its ``config.json``; the safetensors headers for the exact
    parameter count) and whether ``tokenizer`` has a chat template."""
    from streamrft.app.plan import model_shape
    from streamrft.infra.prompts import has_chat_template

    try:
        conf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: cannot read {folder}/config.json: {exc}") from exc
    shape = model_shape(ModelConfig(source="path", path=str(folder)))
    return ModelFacts(folder.name, shape.params, context_of(conf), has_chat_template(tokenizer))


def load_tokenizer_of(folder: Path) -> Any:
    from streamrft.infra.modeling import load_tokenizer

    return load_tokenizer(ModelConfig(source="path", path=str(folder)))


def data_facts(taskset: TasksetConfig, path: str, tokenizer: Any) -> DataFacts:
    """The first :data:`SAMPLE_ROWS` tasks of ``path`` read as ``taskset`` reads them: each
    prompt rendered as the explorer renders it and each answer field as written, counted
    in ``tokenizer``'s tokens."""
    from streamrft.infra.answer_extract import answer_extractor
    from streamrft.infra.prompts import PromptRenderer
    from streamrft.infra.taskset import iter_tasks

    raw = msgspec.structs.replace(taskset, answer_extract=None, path=path, sources=[])
    rows = list(itertools.islice(iter_tasks(path, raw), SAMPLE_ROWS + 1))
    exhausted = len(rows) <= SAMPLE_ROWS
    rows = rows[:SAMPLE_ROWS]
    extract = answer_extractor(taskset.answer_extract) if taskset.answer_extract else None
    tasks, answers, extracted = [], [], []
    for _where, task in rows:
        found = extract(task.answer) if extract else task.answer
        if found is None:
            continue  # the feeder skips it too
        tasks.append(task)
        answers.append(task.answer)
        extracted.append(found)
    if not tasks:
        raise ConfigError(f"taskset: no task with an answer in the first {len(rows)} of {path}")
    prompts = PromptRenderer.from_config(taskset, tokenizer).lengths(tasks)
    eos = 1
    counted = [len(ids) + eos for ids in tokenizer(answers, add_special_tokens=False).input_ids]
    worked = extract is not None and sum(map(len, answers)) > 2 * sum(map(len, extracted))
    total = len(tasks) if exhausted else _parquet_rows(Path(path))
    return DataFacts(
        where=Path(path).name,
        sampled=len(tasks),
        total=total,
        prompt_tokens=tuple(sorted(prompts)),
        answer_tokens=tuple(sorted(counted)),
        worked=worked,
    )


def _parquet_rows(path: Path) -> int | None:
    """Rows of a Parquet file, from its footer (None for other files)."""
    if path.suffix != ".parquet" or not path.is_file():
        return None
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


def hardware(gpus: int | None, gpu_bytes: int | None, device: str = "auto") -> Hardware:
    """The GPUs to size for: ``gpus`` and ``gpu_bytes`` as given (a config for another
    machine), else what torch sees here; ``device`` (``init``'s answer) ``cpu`` means none,
    a ``cuda`` device at least one."""
    vllm = importlib.util.find_spec("vllm") is not None
    if gpus is not None:
        memory = f", {gpu_bytes / GIB:.0f} GiB each" if gpu_bytes else ""
        return Hardware(gpus, gpu_bytes, vllm, f"{gpus} GPU(s) as given (--gpus){memory}")
    if device == "cpu":
        return Hardware(0, None, vllm, "model.device cpu as answered")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        if device.startswith("cuda"):
            return Hardware(1, gpu_bytes, vllm, f"model.device {device} (no GPU visible here)")
        return Hardware(0, None, vllm, "no GPU visible to torch here")
    props = torch.cuda.get_device_properties(0)
    memory_bytes = gpu_bytes or int(props.total_memory)
    seen = f"torch sees {count} GPU(s) here ({props.name}, {memory_bytes / GIB:.0f} GiB)"
    return Hardware(count, memory_bytes, vllm, seen)
