"""``bench/vs_trl.py --quick`` end to end: the one-step check passes, TRL's GRPOTrainer and
``streamrft run`` each train the warmed model 12 steps and learn, their figures and the
ratios are in the JSON line, and the bench leaves no process or folder behind. Skipped
without TRL (the ``bench`` extra)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.helpers.benches import run_bench
from tests.helpers.paths import ROOT
from tests.helpers.processes import processes_mentioning

pytestmark = pytest.mark.e2e

BENCH = ROOT / "bench" / "vs_trl.py"


def _trl_missing() -> str | None:
    spec = importlib.util.spec_from_file_location("vs_trl_setup", BENCH.parent / "vs_trl_setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.trl_missing()


MISSING = _trl_missing()


@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_quick_run_learns_on_both_sides_and_reports_the_ratios():
    code, out, err = run_bench(BENCH, "--quick")
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "vs_trl" and result["mode"] == "compare"
    assert result["trl"] == "1.16.0" and result["device"] == "cpu" and result["steps"] == 12
    assert result["check_failures"] == []
    assert {row[1].split("=")[0] for row in result["mapping"]} >= {
        "num_generations",
        "learning_rate",
        "loss_type",
        "beta",
    }

    points = {p["arm"]: p for p in result["points"]}
    assert set(points) == {"trl", "fixed-1"}
    for arm, p in points.items():
        assert p["exit_code"] == 0 and not p["timed_out"], arm
        assert p["steps"] == 12, arm
        assert p["acc_final"] > p["acc_start"], arm  # it learned
        # one folder, one evaluation (greedy ties may break apart with other thread counts)
        assert abs(p["acc_start"] - points["trl"]["acc_start"]) <= 0.02, arm
        for key in ("ready_s", "first_step_s", "steps_per_s", "tokens_per_s", "wall_s", "cpu_s"):
            assert p[key] > 0, (arm, key)
        assert p["peak_pss_mb"] <= p["peak_rss_mb"], arm
        assert p["acc_at_equal_wall"] is not None, arm
    # one process (short-lived helpers it starts, such as `uname`, may be seen beside it)
    trl = points["trl"]
    assert trl["cpu_s_by_process"]["trl"] >= 0.9 * trl["cpu_s"]
    # supervisor, feeder, explorer, trainer, and the run's own broker and object store
    assert points["fixed-1"]["processes"] >= 6
    assert {"run", "feed", "explore", "train"} <= set(points["fixed-1"]["cpu_s_by_process"])

    [row] = result["ratios"]
    assert row["arm"] == "fixed-1" and row["seed"] == 0
    for key in ("wall_s", "steps_per_s", "tokens_per_s", "cpu_s", "peak_rss_mb", "t90_s"):
        assert row[f"{key}_ratio"] > 0, key  # t90: both reached 0.9 (from about 0.8)
    assert result["summary"]["fixed-1"]["seeds"] == 1

    work = re.search(r"work folder (\S+)", err).group(1)
    assert not Path(work).exists()
    assert processes_mentioning(work) == []
