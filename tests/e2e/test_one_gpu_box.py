"""``run.start_order: explorers_first``, the one-GPU-box order, run on the CPU: the
supervisor starts the explorers and the feeder, and the trainer only once every explorer
has built its engine; the run then goes as usual."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_argv, run_ok
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e


def test_explorers_first_starts_the_trainer_after_the_explorers(tmp_path):
    steps = 4
    proc = run_ok(
        run_argv(
            EXAMPLE,
            None,
            steps,
            tmp_path / "runs",
            None,
            "run.start_order=explorers_first",
            "explorer.count=2",
            "trainer.batch_size=8",
            "explorer.batch_size=4",
            "trainer.warmup_sft_steps=0",
            "eval.interval=0",
            summary=tmp_path / "s.json",
        ),
        tmp_path,
    )
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == steps and s["books"]["trained_twice"] == 0
    assert s["exit_codes"] == {"explorer-0": 0, "explorer-1": 0, "feeder": 0, "trainer": 0}
    lines = proc.stderr.splitlines()
    waiting = [i for i, line in enumerate(lines) if "starting the trainer once the" in line]
    ready = [i for i, line in enumerate(lines) if "explorers ready (engines built)" in line]
    assert len(waiting) == 1 and len(ready) == 1 and waiting[0] < ready[0], proc.stderr[-2000:]
    # every explorer had built its engine before the trainer logged anything (log times
    # have 1 s resolution; the trainer first would log ~seconds before the explorers)
    logs = tmp_path / "runs" / s["run_id"] / "logs"
    trainer_first_line = (logs / "trainer.log").read_text().splitlines()[0][:8]
    for name in ("explorer-0", "explorer-1"):
        ready = [
            line
            for line in (logs / f"{name}.log").read_text().splitlines()
            if "engine transformers ready" in line
        ]
        assert len(ready) == 1, name
        assert ready[0][:8] <= trainer_first_line, (ready[0], trainer_first_line)
