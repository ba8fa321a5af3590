"""The sync-in-the-loop bench runs end to end (--quick: the example's tiny model, every
point a CPU runs: five methods, the ideal and the no-sync baseline) and cleans up."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.helpers.benches import run_bench
from tests.helpers.paths import ROOT
from tests.helpers.processes import processes_mentioning

pytestmark = pytest.mark.e2e

BENCH = ROOT / "bench" / "sync_in_loop.py"
POINTS = ["object_store", "filesystem", "nccl", "shared", "auto", "ideal", "no_sync"]
FIRST_KEYS = ["method", "step_over_ideal", "step_over_no_sync", "sync_wait_s", "receive_s"]
FIRST_KEYS += ["apply_s", "publish_s", "blocked_s", "bytes", "step_s"]


def test_sync_in_loop_bench_prints_its_figures_and_leaves_nothing_behind():
    code, out, err = run_bench(BENCH, "--quick")
    assert code == 0, err[-3000:]
    # stdout is the one JSON line; progress went to stderr
    [line] = out.strip().splitlines()
    result = json.loads(line)
    assert result["bench"] == "sync_in_loop" and result["device"] == "cpu"
    assert result["params"] > 0 and result["shape"] == "example"
    steps = result["steps"]
    points = {p["method"]: p for p in result["points"]}
    assert [p["method"] for p in result["points"]] == POINTS
    ideal = points["ideal"]
    # the ideal: the larger of the ideal run's training and rollout, per step
    assert result["ideal_s"] == max(ideal["train_s"], ideal["rollout_s"]) > 0
    for method, p in points.items():
        assert list(p)[: len(FIRST_KEYS)] == FIRST_KEYS, method
        assert p["exit_code"] == 0 and not p["timed_out"], method
        assert p["steps"] == steps, method
        for ratio in (p["step_over_ideal"], p["step_over_no_sync"]):
            assert ratio is not None and math.isfinite(ratio) and ratio > 0, method
        assert p["step_over_ideal"] == round(p["step_s"] / result["ideal_s"], 3), method
        assert p["step_s"] > 0 and p["train_s"] > 0 and p["rollout_s"] > 0, method
        assert p["publish_s"] > 0 and p["blocked_s"] >= 0 and p["sync_s"] >= 0, method
        # per version applied (the explorer's counters) and per step (its metrics)
        assert p["sync_wait_s"] >= 0 and p["apply_s"] >= 0, method
        assert all(p[k] >= 0 for k in ("step_sync_wait_s", "step_apply_s")), method
        assert p["bytes"] > 0, method
        assert sum(p["versions_by"].values()) == p["versions_applied"], method
    for method in POINTS[:-1]:  # a version after every step, and version 0
        assert points[method]["versions_published"] == steps + 1, method
        assert points[method]["versions_applied"] >= steps // 2, method
    for method in POINTS[:-2]:  # the bytes of each version applied were received
        assert points[method]["receive_s"] > 0 and points[method]["sync_s"] > 0, method
    assert set(points["shared"]["versions_by"]) == {"shared"}
    assert "shared" in points["auto"]["versions_by"]  # on this host: shared memory
    # the ideal's explorer waited for the same versions and received none of them
    assert ideal["receive_s"] in (None, 0.0) and ideal["apply_s"] == 0.0
    # gloo carried the nccl point's versions (not only its object-store fallback)
    assert points["nccl"]["versions_broadcast"] >= 1
    baseline = points["no_sync"]
    assert baseline["step_over_no_sync"] == 1.0
    assert baseline["versions_published"] == 1 and baseline["versions_applied"] == 1
    # the work folder and every process in it are gone
    workdir = re.search(r"# work folder (\S+?);", err).group(1)
    assert not Path(workdir).exists()
    assert processes_mentioning(workdir) == []
