"""``taskset.path`` at a folder laid out as a dataset hub's download: the files of
``taskset.split`` by their names, shards in order, hidden folders passed over; clear errors
for a folder with no such files, mixed formats, or several configurations; the
Configuration guide's GSM8K example, as the page writes it, validated on such a folder;
prompt templates read nested fields by the dotted paths ``prompt_key`` takes."""

from __future__ import annotations

import json
import re

import msgspec
import pyarrow.parquet as pq
import pytest

from streamrft.infra.config import TasksetConfig
from streamrft.infra.data_files import split_files, words
from streamrft.infra.taskset import read_taskset, read_training_set
from streamrft.schemas.errors import ConfigError
from tests.helpers.gsm8k_shape import OVERRIDES, TEST_FILE, write_gsm8k_shaped, write_hub_folder
from tests.helpers.paths import ADDITION, ROOT

pytestmark = pytest.mark.unit

GUIDE = ROOT / "docs" / "configuration-guide.md"


def gsm8k_cfg(**fields) -> TasksetConfig:
    """The taskset settings of :data:`OVERRIDES` (the default example's tasks again)."""
    return msgspec.structs.replace(
        TasksetConfig(),
        id_key="uid",
        prompt_template="{question}=",
        answer_extract="gsm8k",
        **fields,
    )


def addition() -> list[dict]:
    return [json.loads(line) for line in ADDITION.read_text().splitlines()]


def test_a_hub_download_is_read_by_split(tmp_path):
    hub = write_hub_folder(tmp_path / "gsm8k")
    train = read_taskset(hub / "main", gsm8k_cfg())
    expected = addition()
    assert [(t.id, t.prompt, t.answer) for t in train] == [
        (r["id"], r["prompt"], r["answer"]) for r in expected
    ]
    test = read_taskset(hub / "main", gsm8k_cfg(split="test"))
    assert [t.id for t in test] == [r["id"] for r in expected[:10]]
    # the folder read as one file of it is
    assert read_taskset(hub / "main" / TEST_FILE, gsm8k_cfg()) == test


def test_shards_are_read_in_order_and_numbered_across_files(tmp_path):
    rows = pq.read_table(write_gsm8k_shaped(tmp_path / "all.parquet")).drop(["uid"])
    data = tmp_path / "hub" / "data"
    data.mkdir(parents=True)
    # written out of order: read by name, 00000 then 00001
    pq.write_table(rows.slice(60), data / "train-00001-of-00002.parquet")
    pq.write_table(rows.slice(0, 60), data / "train-00000-of-00002.parquet")
    pq.write_table(rows.slice(0, 5), data / "validation-00000-of-00001.parquet")
    tasks = read_taskset(tmp_path / "hub", gsm8k_cfg())
    assert [t.prompt for t in tasks] == [r["prompt"] for r in addition()]
    # no id column: ids are the row's place in the split, not in its file
    assert [t.id for t in tasks[58:62]] == [f"line{i:06d}" for i in (59, 60, 61, 62)]
    dev = read_taskset(tmp_path / "hub", gsm8k_cfg(split="validation"))
    assert [t.prompt for t in dev] == [r["prompt"] for r in addition()[:5]]


def test_jsonl_files_and_split_folders(tmp_path):
    lines = ADDITION.read_text().splitlines(keepends=True)
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "train.jsonl").write_text("".join(lines[:80]))
    (tmp_path / "flat" / "test.jsonl").write_text("".join(lines[80:]))
    plain = TasksetConfig()
    assert [t.id for t in read_taskset(tmp_path / "flat", plain)] == [
        r["id"] for r in addition()[:80]
    ]
    test = read_taskset(tmp_path / "flat", msgspec.structs.replace(plain, split="test"))
    assert [t.id for t in test] == [r["id"] for r in addition()[80:]]
    for split, part in (("train", lines[:30]), ("dev", lines[30:40])):
        (tmp_path / "nested" / split).mkdir(parents=True)
        (tmp_path / "nested" / split / "part-0.jsonl").write_text("".join(part))
    dev = read_taskset(tmp_path / "nested", msgspec.structs.replace(plain, split="validation"))
    assert [t.id for t in dev] == [r["id"] for r in addition()[30:40]]
    # files that name no split are all the train split
    (tmp_path / "unnamed").mkdir()
    (tmp_path / "unnamed" / "00000.jsonl").write_text("".join(lines[:3]))
    (tmp_path / "unnamed" / "00001.jsonl").write_text("".join(lines[3:4]))
    assert len(read_taskset(tmp_path / "unnamed", plain)) == 4
    with pytest.raises(ConfigError, match=r"none of its 2 files names a split .*all are 'train'"):
        read_taskset(tmp_path / "unnamed", msgspec.structs.replace(plain, split="test"))


def test_words_of_a_path_are_whole_words():
    from pathlib import Path

    assert words(Path("main/train-00000-of-00001.parquet")) == {"main", "train", "of"}
    assert words(Path("gsm8k_Train.jsonl")) == {"gsm", "k", "train"}
    assert "test" not in words(Path("contest-00000.parquet"))


def test_a_folder_that_cannot_be_read_says_why(tmp_path):
    hub = write_hub_folder(tmp_path / "gsm8k")
    with pytest.raises(
        ConfigError,
        match=r"its 'train' files are in several folders \(main, socratic\).*point "
        r"taskset\.path at one of them \(such as .*gsm8k/main\)",
    ):
        read_taskset(hub, gsm8k_cfg())
    with pytest.raises(
        ConfigError,
        match=r"taskset\.split: no 'validation' files in .*; its files name the splits test, "
        r"train \(such as test-00000-of-00001\.parquet\)",
    ):
        read_taskset(hub / "socratic", gsm8k_cfg(split="validation"))
    (tmp_path / "empty" / ".cache").mkdir(parents=True)
    (tmp_path / "empty" / ".cache" / "train.jsonl").write_text('{"prompt": "hidden"}\n')
    (tmp_path / "empty" / "README.md").write_text("no data\n")
    with pytest.raises(
        ConfigError, match=r"must hold Parquet \(\.parquet\) or JSONL .* holds none"
    ):
        read_taskset(tmp_path / "empty", TasksetConfig())
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_gsm8k_shaped(mixed / "train-00000-of-00002.parquet")
    (mixed / "train-00001-of-00002.jsonl").write_text(ADDITION.read_text())
    with pytest.raises(
        ConfigError, match=r"'train' files are of mixed formats \(1 \.jsonl, 1 \.parquet\)"
    ):
        split_files(mixed, "train")


def _guide_example() -> str:
    """The Configuration guide's GSM8K config, as the page shows it."""
    blocks = re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "answer_extract: gsm8k" in b and "path: data/gsm8k/" in b]
    return block


def test_the_guides_gsm8k_example_validates_on_a_hub_download(tmp_path, capsys):
    """The example as written, beside a ``data/gsm8k`` folder laid out as the hub's
    download (``main/`` and ``socratic/``): ``streamrft validate`` reads it, and the
    tasks are the rows' questions under the template with their answers extracted."""
    from streamrft.app.cli import main
    from streamrft.infra.config import load_config
    from streamrft.producers.rewards import math_answer

    write_hub_folder(tmp_path / "data" / "gsm8k")
    config = tmp_path / "gsm8k.yaml"
    config.write_text(_guide_example())
    assert main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    train = tmp_path / "data" / "gsm8k" / "main"
    assert f"100 tasks in {train}" in out, out
    tasks = read_training_set(load_config(config).taskset)
    first = addition()[0]
    assert tasks[0].prompt == first["prompt"].rstrip("=") + "\nPut the final answer in \\boxed{}."
    assert tasks[0].answer == first["answer"]
    assert math_answer(f"so \\boxed{{{first['answer']}}}", tasks[0])[0] == 1.0
    # the download's folder itself holds two configurations: validate names them
    (tmp_path / "whole.yaml").write_text(
        _guide_example().replace("data/gsm8k/main/", "data/gsm8k/")
    )
    assert main(["validate", str(tmp_path / "whole.yaml")]) == 1
    assert "several folders (main, socratic)" in capsys.readouterr().out


def test_the_default_examples_overrides_read_a_hub_folder(tmp_path):
    """``tests/helpers/gsm8k_shape.OVERRIDES`` on a hub folder: the feeder's reader gives
    the default example's tasks."""
    from streamrft.infra.config import load_config
    from tests.helpers.paths import EXAMPLE

    hub = write_hub_folder(tmp_path / "gsm8k")
    cfg = load_config(EXAMPLE, [f"taskset.path={hub / 'main'}", *OVERRIDES])
    tasks = read_training_set(cfg.taskset)
    assert [(t.id, t.prompt, t.answer) for t in tasks] == [
        (r["id"], r["prompt"], r["answer"]) for r in addition()
    ]


def test_a_template_reads_nested_fields_by_dotted_path(tmp_path):
    rows = [
        {"q": {"question": "1+1?", "meta": {"n": 2}}, "choices": ["x", "y"], "answer": "2"},
        {"q": {"question": "2+2?", "meta": {"n": 4}}, "choices": ["z", "w"], "answer": "4"},
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def prompts(template: str) -> list[str]:
        c = msgspec.structs.replace(TasksetConfig(), prompt_template=template)
        return [t.prompt for t in read_taskset(tmp_path / "t.jsonl", c)]

    assert prompts("Q: {q.question}") == ["Q: 1+1?", "Q: 2+2?"]
    assert prompts("{q.meta.n} {q[meta][n]:03d} {q[question]} {choices[1]}") == [
        "2 002 1+1? y",
        "4 004 2+2? w",
    ]
    with pytest.raises(
        ConfigError,
        match=r"names 'q\.nope' , which the row lacks \(it has answer, choices, q\.meta\.n, "
        r"q\.question\)",
    ):
        prompts("{q.nope}")
    with pytest.raises(ConfigError, match=r"each \{\.\.\.\} names a field of the row"):
        prompts("{} and {q.question}")
