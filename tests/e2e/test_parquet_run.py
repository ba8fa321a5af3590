"""The default example through the new data path and training controls: its tasks as a
GSM8K-shaped Parquet file (a question column, a rationale ending ``#### N``), the prompt
from a template, the answer from the ``gsm8k`` extractor, a cosine learning-rate schedule
with warm-up, and two optimizer updates per pass (``mini_batch_size``). It learns like
the default example, and every step's learning rate is the schedule's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from streamrft.app.watch.metrics_log import read_metrics
from streamrft.consumers.lr_schedule import lr_factor
from streamrft.infra.config import TrainerConfig
from tests.helpers.cli import run_argv, run_ok
from tests.helpers.gsm8k_shape import OVERRIDES, write_gsm8k_shaped
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e

STEPS = 150
"""The example's own step budget (``trainer.max_steps``), warm-up and peak rate."""
LR = 3e-4


def test_a_parquet_taskset_with_a_template_a_schedule_and_mini_batches_learns(tmp_path):
    data = write_gsm8k_shaped(tmp_path / "addition.parquet")
    summary_path = tmp_path / "summary.json"
    run_ok(
        run_argv(
            EXAMPLE,
            None,
            STEPS,
            tmp_path / "runs",
            None,
            f"taskset.path={data}",
            *OVERRIDES,
            "eval.interval=50",
            "trainer.lr_schedule=cosine",
            "trainer.lr_warmup_steps=5",
            "trainer.min_lr_ratio=0.1",
            "trainer.mini_batch_size=16",
            summary=summary_path,
        ),
        tmp_path,
    )
    s = json.loads(summary_path.read_text())
    assert s["steps"] == STEPS and s["groups_trained"] == STEPS * 32
    assert s["eval_accuracy_last"] >= 0.85, s["eval_accuracy"]
    assert s["eval_accuracy_last"] >= s["eval_accuracy_first"] + 0.1, s["eval_accuracy"]
    assert s["dead_letters"] == 0
    trained = {
        e.step: e.values
        for e in read_metrics(Path(s["metrics_file"]))
        if e.component == "trainer" and "train/loss" in e.values
    }
    assert sorted(trained) == list(range(1, STEPS + 1))
    schedule = TrainerConfig(
        lr=LR, lr_schedule="cosine", lr_warmup_steps=5, min_lr_ratio=0.1, max_steps=STEPS
    )
    for step, values in trained.items():
        assert math.isclose(values["train/lr"], LR * lr_factor(step - 1, schedule), rel_tol=1e-9)
    assert trained[1]["train/lr"] == pytest.approx(LR / 5)
    assert trained[STEPS]["train/lr"] < LR / 5  # decayed towards the floor
    assert all(v["train/tokens_per_s"] > 0 for v in trained.values())
