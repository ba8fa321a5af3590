"""Tasksets beyond JSONL: Parquet files and saved Hugging Face datasets give the same tasks
as JSONL; nested fields by dotted path; a prompt template; answer extraction (GSM8K's
``#### N``, ``\\boxed{}``, a pattern) with rows it cannot read skipped and counted; and
the rewards never read an answer inside ``<think>...</think>``."""

from __future__ import annotations

import json
import logging

import datasets
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrft.infra.answer_extract import answer_extractor, without_thinking
from streamrft.infra.config import TasksetConfig
from streamrft.infra.taskset import read_taskset
from streamrft.producers.rewards import answer_format, last_number, math_answer
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task

pytestmark = pytest.mark.unit

ROWS = [
    {
        "id": f"gsm-{i}",
        "question": f"Tom has {i} apples and buys {i * 100} more. How many now?",
        "answer": f"He has {i} + {i * 100} = {i * 101}.\n#### {i * 101:,}",
        "extra_info": {"level": i % 3, "source": "gsm8k-shaped"},
    }
    for i in range(1, 13)
]
GSM8K = {
    "prompt_template": "{question}\nPut the final answer in \\boxed{{}}.",
    "answer_extract": "gsm8k",
}


def cfg(**fields) -> TasksetConfig:
    return msgspec.structs.replace(TasksetConfig(), **fields)


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_parquet(path, rows) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)


def test_jsonl_parquet_and_a_saved_dataset_give_the_same_tasks(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    write_parquet(tmp_path / "t.parquet", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    split = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    )
    split.save_to_disk(str(tmp_path / "dict"))
    c = cfg(**GSM8K)
    from_jsonl = read_taskset(tmp_path / "t.jsonl", c)
    assert len(from_jsonl) == 12
    for other in (tmp_path / "t.parquet", tmp_path / "one", tmp_path / "dict"):
        assert read_taskset(other, c) == from_jsonl, other
    assert [t.id for t in read_taskset(tmp_path / "dict", cfg(split="test", **GSM8K))] == [
        "gsm-1",
        "gsm-2",
    ]
    with pytest.raises(
        ConfigError, match=r"taskset\.split: 'validation' is not a split .*test, train"
    ):
        read_taskset(tmp_path / "dict", cfg(split="validation"))


def test_template_and_gsm8k_extractor_make_a_task_the_math_reward_scores(tmp_path):
    write_parquet(tmp_path / "t.parquet", ROWS)
    task = read_taskset(tmp_path / "t.parquet", cfg(**GSM8K))[11]
    assert task.prompt == (
        "Tom has 12 apples and buys 1200 more. How many now?\nPut the final answer in \\boxed{}."
    )
    assert task.answer == "1212"  # "#### 1,212" without the separator
    assert json.loads(task.metadata["extra_info"]) == {"level": 0, "source": "gsm8k-shaped"}
    assert math_answer("so it is \\boxed{1212}", task)[0] == 1.0
    assert math_answer("so it is \\boxed{1,212}", task)[0] == 1.0
    assert math_answer("so it is \\boxed{1211}", task)[0] == 0.0
    # without the extractor, the whole rationale is the answer and nothing ever matches
    whole = read_taskset(tmp_path / "t.parquet", cfg(prompt_template=GSM8K["prompt_template"]))
    assert math_answer("\\boxed{1212}", whole[11])[0] == 0.0


def test_nested_fields_by_dotted_path(tmp_path):
    rows = [
        {"data": {"q": "1+1?", "uid": "a"}, "reward_model": {"ground_truth": "2"}},
        {"data": {"q": "2+2?", "uid": "b"}, "reward_model": {"ground_truth": "4"}},
    ]
    write_parquet(tmp_path / "t.parquet", rows)
    c = cfg(prompt_key="data.q", answer_key="reward_model.ground_truth", id_key="data.uid")
    tasks = read_taskset(tmp_path / "t.parquet", c)
    assert [(t.id, t.prompt, t.answer) for t in tasks] == [("a", "1+1?", "2"), ("b", "2+2?", "4")]
    nested = cfg(prompt_template="Q: {data[q]}", answer_key="reward_model.ground_truth")
    assert read_taskset(tmp_path / "t.parquet", nested)[1].prompt == "Q: 2+2?"


def test_rows_the_extractor_cannot_read_are_skipped_and_counted(tmp_path, caplog):
    rows = [*ROWS[:3], {"id": "no-marker", "question": "?", "answer": "forty two"}]
    write_jsonl(tmp_path / "t.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="streamrft.infra.taskset"):
        tasks = read_taskset(tmp_path / "t.jsonl", cfg(**GSM8K))
    assert [t.id for t in tasks] == ["gsm-1", "gsm-2", "gsm-3"]
    assert "1 rows skipped: taskset.answer_extract 'gsm8k' found no answer" in caplog.text


def test_the_named_extractors_and_a_pattern():
    assert answer_extractor("gsm8k")("a\n#### 1,234 ") == "1234"
    assert answer_extractor("gsm8k")("no marker") is None
    assert answer_extractor("boxed")("x \\boxed{\\frac{1}{2}} then \\boxed{ 7 }") == "7"
    assert answer_extractor(r"Answer:\s*(\S+)")("... Answer: 12") == "12"
    assert answer_extractor(r"Answer:\s*(\S+)")("nothing") is None
    with pytest.raises(ConfigError, match="has 0 groups; give one group"):
        answer_extractor(r"Answer: \d+")
    with pytest.raises(ConfigError, match="is not a regular expression"):
        answer_extractor(r"(unclosed")


def test_bad_sources_are_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"bad\.parquet: not a readable Parquet file"):
        read_taskset(tmp_path / "bad.parquet", cfg())
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match=r"a folder must hold Parquet .* or be a dataset saved"):
        read_taskset(tmp_path / "folder", cfg())
    write_jsonl(tmp_path / "t.jsonl", ROWS[:1])
    with pytest.raises(ConfigError, match=r"prompt_template names 'problem' , which the row lacks"):
        read_taskset(tmp_path / "t.jsonl", cfg(prompt_template="{problem}"))
    with pytest.raises(ConfigError, match="does not exist"):
        read_taskset(tmp_path / "missing.parquet", cfg())


def test_answers_inside_thinking_are_never_read():
    task = Task(id="t", prompt="?", answer="12")
    assert without_thinking("<think>maybe \\boxed{11}</think> so \\boxed{12}") == " so \\boxed{12}"
    assert math_answer("<think>maybe \\boxed{12}</think> it is \\boxed{11}", task)[0] == 0.0
    assert math_answer("<think>12? 11?</think> it is \\boxed{12}", task)[0] == 1.0
    # cut off while thinking: no answer was given
    assert math_answer("<think>the answer is \\boxed{12} and", task)[0] == 0.0
    assert last_number("<think>12</think> I say 11", task)[0] == 0.0
    assert answer_format("<think>\\boxed{12}</think>", task)[0] == 0.0


def test_explorer_reward_skips_thinking_off_reads_the_whole_response():
    from streamrft.producers.rewards import REWARDS, get_reward

    task = Task(id="t", prompt="?", answer="12")
    cut = "<think>the answer is \\boxed{12} and"  # cut off while thinking
    for name in ("last_number", "math_answer", "format", "math_answer_format"):
        assert get_reward(name) is REWARDS[name]
        assert get_reward(name, skips_thinking=False)(cut, task)[0] > 0.5, name
        assert get_reward(name)(cut, task)[0] == 0.0, name
    assert get_reward("math_answer_format", False)("<think>x</think> \\boxed{12}", task)[0] == 1.0
    assert get_reward("exact_match", False) is REWARDS["exact_match"]


def test_sources_in_a_config_file_resolve_read_each_their_own_way_and_validate(tmp_path, capsys):
    """``taskset.sources`` relative to the config, per-source reading rules over the
    section's, ids prefixed by the source's name; ``streamrft validate`` counts each."""
    from streamrft.app.cli import main
    from streamrft.infra.config import load_config
    from streamrft.infra.taskset import read_training_set

    data = tmp_path / "data"
    data.mkdir()
    write_parquet(data / "gsm.parquet", ROWS)
    write_jsonl(data / "plain.jsonl", [{"id": "a", "prompt": "1+1=", "answer": "2"}])
    config = tmp_path / "mix.yaml"
    config.write_text(
        "taskset:\n"
        "  sources:\n"
        "    - {path: data/gsm.parquet, weight: 3, prompt_template: '{question}',"
        " answer_extract: gsm8k}\n"
        "    - {path: data/plain.jsonl, name: plain}\n"
    )
    cfg = load_config(config)
    assert [s.path for s in cfg.taskset.sources] == [
        str(data / "gsm.parquet"),
        str(data / "plain.jsonl"),
    ]
    tasks = read_training_set(cfg.taskset)
    assert [t.id for t in tasks] == [f"gsm/gsm-{i}" for i in range(1, 13)] + ["plain/a"]
    assert tasks[0].prompt == ROWS[0]["question"] and tasks[0].answer == "101"
    assert (tasks[-1].prompt, tasks[-1].answer) == ("1+1=", "2")  # the section's own reading
    assert main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"12 tasks in {data / 'gsm.parquet'} (weight 3); 1 tasks in" in out


@pytest.mark.parametrize(
    ("taskset", "message"),
    [
        ({"path": "x.jsonl", "sources": [{"path": "y.jsonl"}]}, "give taskset.path .* not both"),
        ({}, r"taskset.path: a taskset is required"),
        ({"path": "x.jsonl", "epoch_tasks": 10}, "sizes an epoch of taskset.sources"),
        (
            {"sources": [{"path": "a/t.jsonl"}, {"path": "b/t.parquet"}]},
            r"two sources named alike \(t, t\); give each a name",
        ),
        ({"sources": [{"path": "t.jsonl", "weight": 0}]}, r"sources\[0\]\.weight: Expected"),
        ({"sources": [{"path": "t.jsonl", "prompt": "p"}]}, r"unknown field .prompt."),
    ],
)
def test_a_wrong_mix_is_named(taskset, message):
    from streamrft.infra.config import from_dict

    with pytest.raises(ConfigError, match=message):
        from_dict({"taskset": taskset})


def test_a_missing_source_file_is_named(tmp_path):
    from streamrft.infra.config import load_config

    (tmp_path / "c.yaml").write_text("taskset:\n  sources:\n    - {path: here.jsonl}\n")
    with pytest.raises(ConfigError, match=r"taskset.sources\[0\].path: '.*here.jsonl' does not"):
        load_config(tmp_path / "c.yaml")
