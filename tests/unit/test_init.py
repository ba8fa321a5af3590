"""``streamrft init``: answered by flags or through stdin, it writes a config that loads,
validates and holds what was answered; ``--expert`` writes every field with its
documentation; a wrong answer stops before a file is written."""

from __future__ import annotations

import subprocess

import pytest

from streamrft.app.cli import main
from streamrft.infra.config import Config, load_config
from streamrft.schemas.errors import ConfigError
from tests.helpers.cli import env, streamrft_cmd
from tests.helpers.paths import ADDITION, ROOT

pytestmark = pytest.mark.unit

GSM8K_SHAPED = ROOT / "examples" / "data" / "gsm8k_format_sample.parquet"


def test_flags_and_suggestions_write_a_config_that_validates(tmp_path, capsys):
    out = tmp_path / "gsm.yaml"
    assert main(["init", "--yes", "--data", str(GSM8K_SHAPED), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "first row of" in printed.err and "#### 2" in printed.err  # the sample shown
    assert "taskset       ok: 512 tasks" in printed.out
    assert "trainer" in printed.out and "GiB" in printed.out  # plan's table
    cfg = load_config(out)
    t = cfg.taskset
    assert (t.path, t.prompt_template, t.answer_key, t.answer_extract) == (
        str(GSM8K_SHAPED), "{question}", "answer", "gsm8k"
    )  # fmt: skip
    assert (cfg.explorer.reward, cfg.algorithm.type, cfg.model.source) == (
        "math_answer", "grpo", "tiny"
    )  # fmt: skip
    assert main(["validate", str(out)]) == 0
    text = out.read_text()
    assert "# How the answer field becomes the reference answer: `gsm8k`" in text
    assert "kafka:" not in text  # beginner: only what was chosen


def test_answers_through_stdin(tmp_path):
    data = tmp_path / "data" / "tasks.jsonl"
    data.parent.mkdir()
    data.write_text(ADDITION.read_text())
    answers = "tiny\n" + f"{data}\n" + "\n\n\n\n" + "dapo\n" + "\n"
    done = subprocess.run(
        streamrft_cmd("init", "--out", str(tmp_path / "mine.yaml")),
        input=answers,
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for question in ("Model:", "Task file:", "Prompt:", "Reading the answer:", "Algorithm"):
        assert question in done.stderr
    cfg = load_config(tmp_path / "mine.yaml")
    assert (cfg.taskset.prompt_key, cfg.taskset.answer_extract) == ("prompt", None)
    assert (cfg.explorer.reward, cfg.algorithm.type, cfg.model.device) == (
        "exact_match", "dapo", "cpu"
    )  # fmt: skip
    assert "path: data/tasks.jsonl" in (tmp_path / "mine.yaml").read_text()  # relative


def test_expert_writes_every_field_with_its_documentation(tmp_path, capsys):
    out = tmp_path / "all.yaml"
    argv = ["init", "--yes", "--expert", "--data", str(ADDITION), "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    cfg = load_config(out)
    assert cfg.taskset.path == str(ADDITION) and cfg == load_config(out)
    text = out.read_text()
    import msgspec

    for section in msgspec.structs.fields(Config):
        assert f"\n{section.name}:\n" in text
        for f in msgspec.structs.fields(section.type):
            assert f"\n  {f.name}: " in text, f"{section.name}.{f.name}"
    # each field's whole documentation, here kafka.partitions' (wrapped over lines)
    assert "  # Partitions of the tasks and experiences topics. A tasks partition feeds" in text


def test_wrong_answers_are_named_and_an_existing_file_is_kept(tmp_path, capsys):
    from streamrft.app.init import Answers, init

    out = tmp_path / "x.yaml"
    with pytest.raises(ConfigError, match=r"model.device: Expected `str` matching"):
        init(Answers(data=str(ADDITION), device="gpu0"), out, False, None)
    assert not out.exists()  # a field the config refuses: nothing written
    argv = ["init", "--yes", "--data", str(ADDITION), "--out", str(out)]
    assert main([*argv, "--reward", "nope"]) == 1  # written, and the check says why
    assert "names         FAILED: explorer.reward: unknown reward 'nope'" in capsys.readouterr().out
    out.write_text("mine\n")
    assert main(argv) != 0
    assert out.read_text() == "mine\n"
    assert "exists; give another file or --force" in capsys.readouterr().err


def test_a_saved_dataset_dict_asks_for_its_split_and_names_are_made_valid(tmp_path, capsys):
    import datasets

    rows = {"problem": ["1+1?", "2+2?"], "solution": ["\\boxed{2}", "\\boxed{4}"]}
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "dd")
    out = tmp_path / "my run.yaml"
    assert main(["init", "--yes", "--data", str(tmp_path / "dd"), "--out", str(out)]) == 0
    capsys.readouterr()
    cfg = load_config(out)
    t = cfg.taskset
    assert (t.split, t.prompt_template, t.answer_key, t.answer_extract) == (
        "test", "{problem}", "solution", "boxed"
    )  # fmt: skip
    assert cfg.run.name == "my-run"


def test_input_that_ends_early_is_no_answer(tmp_path):
    done = subprocess.run(
        streamrft_cmd("init", "--out", str(tmp_path / "x.yaml")),
        input="tiny\n",
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert done.returncode == 2 and "input ended before every question" in done.stderr
    assert not (tmp_path / "x.yaml").exists()
