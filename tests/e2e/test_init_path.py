"""A new user's path, as processes: ``streamrft init`` with a model folder and GSM8K-shaped
Parquet data writes a sized config, ``validate --strict`` passes it, ``plan`` sizes it,
and ``streamrft run`` trains two steps with it (the tiny Llama saved as a folder, so the
run is quick; the sizes are the model's and the data's, not the tiny model's defaults)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrft.app.watch.metrics_log import read_metrics
from streamrft.infra.config import load_config
from tests.helpers.cli import run_argv, run_ok, streamrft_cmd
from tests.helpers.gsm8k_shape import write_gsm8k_shaped
from tests.helpers.model_folders import write_tiny_folder

pytestmark = pytest.mark.e2e

STEPS = 2


def test_init_validate_plan_and_a_two_step_run(tmp_path):
    model = write_tiny_folder(tmp_path / "models" / "tiny-llama")
    (tmp_path / "data").mkdir()
    data = write_gsm8k_shaped(tmp_path / "data" / "train.parquet")
    config = tmp_path / "my_run.yaml"
    init = run_ok(
        streamrft_cmd(
            "init", "--yes", "--model", str(model), "--data", str(data), "--out", str(config),
            "--device", "cpu",
        ),
        tmp_path,
    )  # fmt: skip
    assert "sized for" in init.stdout and "  explorer.max_new_tokens = 32" in init.stdout
    cfg = load_config(config)
    assert (cfg.explorer.max_new_tokens, cfg.taskset.max_prompt_tokens) == (32, 32)
    assert "path: models/tiny-llama" in config.read_text()  # relative to the file
    checked = run_ok(streamrft_cmd("validate", str(config), "--strict"), tmp_path)
    assert checked.stdout.splitlines()[-1] == "config ok"
    planned = run_ok(streamrft_cmd("plan", str(config), "--device-memory", "1GiB"), tmp_path)
    assert f"model: {model}" in planned.stdout and "GiB of 1.00 GiB: fits" in planned.stdout
    summary = tmp_path / "summary.json"
    run_ok(
        run_argv(config, None, STEPS, tmp_path / "runs", None, "eval.max_tasks=8", summary=summary),
        tmp_path,
        timeout=900,
    )
    s = json.loads(summary.read_text())
    assert s["steps"] == STEPS and s["exit_codes"] == {"trainer": 0, "explorer-0": 0, "feeder": 0}
    assert s["groups_trained"] == STEPS * cfg.trainer.batch_size and s["dead_letters"] == 0
    trained = [
        e.values
        for e in read_metrics(Path(s["metrics_file"]))
        if e.component == "trainer" and "train/loss" in e.values
    ]
    assert len(trained) == STEPS
    for values in trained:  # the sizes init wrote, not the tiny model's 16 tokens and 32 x 8
        assert values["train/response_length_max"] <= 32
        assert 0 < values["train/lr"] <= cfg.trainer.lr
