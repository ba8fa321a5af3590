"""The progress bar of ``streamrft run`` says what the trainer does before its first step
(its SFT warm-up named, with its steps) instead of ``reward nan``; then the reward and the
evaluation accuracy."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from streamrft.app.supervisor import _show
from streamrft.app.watch.monitor import RunMonitor
from streamrft.infra.config import load_config, with_run_id
from streamrft.schemas.events import MetricsEvent, RunState, StatusEvent
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.unit


def trainer_status(detail: str, t: float) -> StatusEvent:
    return StatusEvent(
        component="trainer",
        role="trainer",
        state=RunState.RUNNING,
        step=0,
        version=-1,
        detail=detail,
        created_at=t,
    )


def trainer_metrics(step: int, values: dict[str, float]) -> MetricsEvent:
    return MetricsEvent(run="r1", component="trainer", step=step, version=step, values=values)


def test_the_bar_names_the_warm_up_then_shows_reward_and_accuracy():
    cfg = with_run_id(load_config(EXAMPLE), "r1")
    assert cfg.trainer.warmup_sft_steps == 100  # the default example's warm-up
    monitor, out = RunMonitor(cfg), io.StringIO()
    bar = tqdm(total=cfg.trainer.max_steps, desc="train", file=out, ncols=200, mininterval=0)
    lines = []

    def shown() -> str:
        _show(bar, monitor)
        lines.append(out.getvalue().split("\r")[-1])
        return lines[-1]

    assert "starting: the trainer builds its model" in shown()
    monitor.on_status(trainer_status("SFT warm-up, 100 steps", 1.0))
    assert (
        "0/150" in shown() and "SFT warm-up, 100 steps (supervised) before RL step 1" in lines[-1]
    )
    monitor.on_metrics(
        trainer_metrics(0, {"warmup/sft_loss_first": 2.5, "warmup/sft_loss_last": 0.8})
    )
    assert "SFT warm-up done (loss 0.800); first evaluation" in shown()
    monitor.on_metrics(trainer_metrics(0, {"eval/accuracy": 0.5}))
    monitor.on_status(trainer_status("training", 2.0))
    assert "waiting for the first batch of experiences" in shown()
    monitor.on_metrics(trainer_metrics(1, {"train/reward_mean": 0.25}))
    assert "1/150" in shown() and "reward 0.25 eval_acc 0.50" in lines[-1]
    bar.close()
    assert not any("nan" in line for line in lines), lines


def test_without_a_warm_up_or_an_evaluation_no_nan_either():
    monitor = RunMonitor(with_run_id(load_config(EXAMPLE, ["trainer.warmup_sft_steps=0"]), "r1"))
    monitor.on_status(trainer_status("", 1.0))
    assert monitor.progress() == "before step 1 (RUNNING)"
    monitor.on_metrics(trainer_metrics(1, {"train/reward_mean": 0.125}))
    assert monitor.progress() == "reward 0.12"
