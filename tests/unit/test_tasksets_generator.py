"""`streamrft tasks make word_problems`: deterministic, distinct, correct, readable as a taskset."""

from __future__ import annotations

import json
import re

import pytest

from streamrft.app.cli import main
from streamrft.infra.config import TasksetConfig
from streamrft.infra.taskset import read_taskset
from streamrft.producers.rewards import math_answer_format
from streamrft.producers.tasksets import (
    INSTRUCTION,
    KINDS,
    make_splits,
    word_problems,
    write_rows,
)
from streamrft.schemas.errors import ConfigError

pytestmark = pytest.mark.unit

# What each kind computes from the numbers of its question, in the order they are written:
# recomputed here from the text, independently of the generator.
RECOMPUTE = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda total, b: total // b if total % b == 0 else None,
    "add_sub": lambda a, b, c: a + b - c,
    "sub_sub": lambda a, b, c: a - b - c,
    "mul_add": lambda a, b, c: a * b + c,
}
ONE_OPERATION = {"add", "sub", "mul", "div"}
OPERATIONS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}


def question_of(line: dict) -> str:
    (message,) = line["messages"]
    assert message["role"] == "user"
    question, instruction = message["content"].split("\n")
    assert instruction == INSTRUCTION
    return question


@pytest.mark.parametrize("max_number", [49, 9])
def test_every_answer_is_right_and_every_number_small(max_number):
    lines = word_problems(700, seed=11, max_number=max_number)
    assert {line["kind"] for line in lines} == set(KINDS) == set(RECOMPUTE)
    for line in lines:
        numbers = [int(x) for x in re.findall(r"\d+", question_of(line))]
        assert len(numbers) == (2 if line["kind"] in ONE_OPERATION else 3), line
        answer = RECOMPUTE[line["kind"]](*numbers)
        assert answer is not None and answer >= 0, line
        assert line["answer"] == str(answer), line
        operands = numbers if line["kind"] != "div" else numbers[1:]  # a share is written whole
        assert all(0 < n <= max_number for n in operands), line


def test_the_same_seed_gives_the_same_tasks_and_another_seed_others():
    assert make_splits("word_problems", 50, 10, 3) == make_splits("word_problems", 50, 10, 3)
    assert make_splits("word_problems", 50, 10, 3) != make_splits("word_problems", 50, 10, 4)


def test_splits_are_distinct_and_numbered():
    train, evals = make_splits("word_problems", 300, 100, 0)
    assert [x["id"] for x in train] == [f"word_problems-train-{i:05d}" for i in range(300)]
    assert [x["id"] for x in evals] == [f"word_problems-eval-{i:05d}" for i in range(100)]
    questions = [question_of(x) for x in train + evals]
    assert len(set(questions)) == 400  # no duplicate, and no eval task is a training task


def test_the_reward_scores_a_right_tagged_answer_fully(tmp_path):
    lines = word_problems(20, seed=1)
    path = write_rows(lines, tmp_path / "wp.jsonl")
    for line, task in zip(lines, read_taskset(path, TasksetConfig()), strict=True):
        assert math_answer_format(f"<answer>{line['answer']}</answer>", task)[0] == 1.0
        assert math_answer_format("<answer>-1</answer>", task)[0] == pytest.approx(0.1)


def test_the_templates_can_be_chosen():
    lines = word_problems(50, seed=2, kinds=["add", "sub"])
    assert {line["kind"] for line in lines} == {"add", "sub"}


def test_bad_requests_are_config_errors():
    with pytest.raises(ConfigError, match=r"kinds must be among add, sub.*got add, pow"):
        word_problems(5, 0, kinds=["add", "pow"])
    with pytest.raises(ConfigError, match=r"--max-number >= 3 \(got 2\)"):
        word_problems(5, 0, max_number=2)
    with pytest.raises(ConfigError, match=r"unknown task set 'nope'; known: word_problems"):
        make_splits("nope", 1, 0, 0)
    with pytest.raises(ConfigError, match=r"--n must be >= 1"):
        make_splits("word_problems", 0, 0, 0)


def test_the_command_writes_a_taskset_and_its_eval_split(tmp_path, capsys):
    out = tmp_path / "data" / "wp.jsonl"
    argv = ["tasks", "make", "word_problems", "--n", "30", "--eval-n", "5", "--seed", "7"]
    options = ["--max-number", "20", "--kinds", "add,mul_add"]
    assert main([*argv, *options, "--out", str(out)]) == 0
    assert "30 tasks written" in capsys.readouterr().out
    train = read_taskset(out, TasksetConfig())
    evals = read_taskset(tmp_path / "data" / "wp.eval.jsonl", TasksetConfig())
    assert len(train) == 30 and len(evals) == 5
    assert all(t.messages and not t.prompt and t.metadata["kind"] in KINDS for t in train)
    expected, _ = make_splits("word_problems", 30, 5, 7, max_number=20, kinds=["add", "mul_add"])
    assert [json.loads(x) for x in out.read_text().splitlines()] == expected
    # --eval-n 0: no eval file
    other = tmp_path / "only.jsonl"
    assert main([*argv[:3], "--n", "3", "--eval-n", "0", "--out", str(other)]) == 0
    assert not (tmp_path / "only.eval.jsonl").exists()


def test_the_gsm8k_shape_holds_the_same_problems_with_rationales_that_compute_the_answer():
    chat = word_problems(300, seed=5)
    gsm8k = word_problems(300, seed=5, shape="gsm8k")
    assert [question_of(c) for c in chat] == [g["question"] for g in gsm8k]
    for c, g in zip(chat, gsm8k, strict=True):
        rationale, final = g["answer"].rsplit("\n#### ", 1)
        assert final == c["answer"] and g["kind"] == c["kind"] and g["id"] == c["id"]
        calculations = re.findall(r"<<([^=]+)=(-?\d+)>>(-?\d+)", rationale)
        assert len(calculations) == (1 if g["kind"] in ONE_OPERATION else 2), g
        for expr, inside, written in calculations:
            a, op, b = re.fullmatch(r"(\d+)([-+*/])(\d+)", expr).groups()
            assert OPERATIONS[op](int(a), int(b)) == int(inside) == int(written), g
        assert calculations[-1][2] == final  # the last calculation is the answer
    with pytest.raises(ConfigError, match=r"unknown shape 'csv'; known: chat, gsm8k"):
        word_problems(5, 0, shape="csv")


def test_the_gsm8k_shape_through_a_template_and_the_extractor_is_the_chat_taskset(tmp_path):
    train, _ = make_splits("word_problems", 40, 0, 3)
    rows, _ = make_splits("word_problems", 40, 0, 3, shape="gsm8k")
    chat = read_taskset(write_rows(train, tmp_path / "chat.jsonl"), TasksetConfig())
    cfg = TasksetConfig(prompt_template="{question}\n" + INSTRUCTION, answer_extract="gsm8k")
    parquet = read_taskset(write_rows(rows, tmp_path / "g.parquet"), cfg)
    assert [(t.id, t.answer) for t in parquet] == [(t.id, t.answer) for t in chat]
    assert [t.prompt for t in parquet] == [t.messages[0].content for t in chat]
    for task in parquet:
        assert math_answer_format(f"<answer>{task.answer}</answer>", task)[0] == 1.0


def test_the_reference_parquet_files_are_what_the_command_makes(tmp_path):
    """examples/data/gsm8k_format_sample*.parquet: the line in the SmolLM2 example's header
    makes them again, byte for byte the same rows."""
    import pyarrow.parquet as pq

    from tests.helpers.paths import ROOT

    out = tmp_path / "g.parquet"
    argv = ["tasks", "make", "word_problems", "--n", "512", "--eval-n", "48", "--seed", "0"]
    assert main([*argv, "--max-number", "9", "--kinds", "add,sub", "--shape", "gsm8k",
                 "--out", str(out)]) == 0  # fmt: skip
    data = ROOT / "examples" / "data"
    for made, kept in ((out, "gsm8k_format_sample.parquet"),
                       (tmp_path / "g.eval.parquet", "gsm8k_format_sample.eval.parquet")):  # fmt: skip
        assert pq.read_table(made).to_pylist() == pq.read_table(data / kept).to_pylist()
