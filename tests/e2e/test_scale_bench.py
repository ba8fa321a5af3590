"""The explorer scaling bench runs end to end (one explorer, a few steps) and cleans up."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import env
from tests.helpers.paths import ROOT
from tests.helpers.processes import processes_mentioning

pytestmark = pytest.mark.e2e

BENCH = ROOT / "bench" / "scale_explorers.py"
STEPS = 6
COST = 0.0005  # 32 x 8 x 4 tokens: 0.5 s of rollout per batch


def test_scale_bench_prints_its_figures_and_leaves_nothing_behind():
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--explorers",
            "1",
            "--steps",
            str(STEPS),
            "--seconds-per-token",
            str(COST),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "scale_explorers"
    [point] = result["points"]
    assert point["explorers"] == 1 and point["exit_code"] == 0 and not point["timed_out"]
    assert point["trainer_steps"] == STEPS
    # the rollout is the simulated engine's sleep: 1,024 tokens at COST, plus a little
    assert 1024 * COST <= point["rollout_s"] < 1024 * COST + 0.5
    assert 0 < point["train_s"] < point["step_s"] + 1
    assert point["bound_s"] == pytest.approx(1.25 * (point["rollout_s"] + point["train_s"]), 1e-3)
    assert point["stale_dropped"] == 0 and point["trained_of_consumed"] == 1.0
    assert point["rebalances"] >= 1
    # the table came first, and the work folder and every process in it are gone
    assert done.stdout.splitlines()[0].startswith("explorers")
    workdir = re.search(r"# work folder (\S+)", done.stderr).group(1)
    assert not Path(workdir).exists()
    assert processes_mentioning(workdir) == []
