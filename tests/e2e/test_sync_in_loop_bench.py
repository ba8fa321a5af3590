"""The sync-in-the-loop bench runs end to end (--quick: the example's tiny model, its four
points) and cleans up."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import env
from tests.helpers.paths import ROOT
from tests.helpers.processes import processes_mentioning

pytestmark = pytest.mark.e2e

BENCH = ROOT / "bench" / "sync_in_loop.py"
POINTS = ["object_store", "filesystem", "nccl", "shared", "auto", "no_sync"]
FIRST_KEYS = ["method", "step_over_ideal", "publish_s", "fetch_s", "apply_s", "blocked_s"]
FIRST_KEYS += ["bytes", "step_s"]
TIMEOUT_S = 780  # under pytest's 900: room to stop the bench and look


def run_bench(*args: str) -> tuple[int, str, str]:
    """The bench's exit code, stdout and stderr; past ``TIMEOUT_S`` it is stopped with
    SIGTERM (it then stops its runs and services and removes its folder) and the test fails."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), *args],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"the bench took over {TIMEOUT_S} s:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def test_sync_in_loop_bench_prints_its_figures_and_leaves_nothing_behind():
    code, out, err = run_bench("--quick")
    assert code == 0, err[-3000:]
    # stdout is the one JSON line; progress went to stderr
    [line] = out.strip().splitlines()
    result = json.loads(line)
    assert result["bench"] == "sync_in_loop" and result["device"] == "cpu"
    assert result["params"] > 0
    steps = result["steps"]
    points = {p["method"]: p for p in result["points"]}
    assert [p["method"] for p in result["points"]] == POINTS
    for method, p in points.items():
        assert list(p)[: len(FIRST_KEYS)] == FIRST_KEYS, method
        assert p["exit_code"] == 0 and not p["timed_out"], method
        assert p["steps"] == steps, method
        ratio = p["step_over_ideal"]
        assert ratio is not None and math.isfinite(ratio) and ratio > 0, method
        assert p["step_s"] > 0 and p["train_s"] > 0 and p["rollout_s"] > 0, method
        assert p["publish_s"] > 0 and p["blocked_s"] >= 0 and p["sync_s"] > 0, method
        # the follower reports fetch and apply together (sync_s) today
        assert all(p[k] is None or p[k] >= 0 for k in ("fetch_s", "apply_s")), method
        assert p["bytes"] > 0, method
    for method in POINTS[:-1]:  # a version after every step, and version 0
        assert points[method]["versions_published"] == steps + 1, method
        assert points[method]["versions_applied"] >= steps // 2, method
    # gloo carried the nccl point's versions (not only its object-store fallback)
    assert points["nccl"]["versions_broadcast"] >= 1
    baseline = points["no_sync"]
    assert baseline["step_over_ideal"] == 1.0
    assert baseline["versions_published"] == 1 and baseline["versions_applied"] == 1
    # the work folder and every process in it are gone
    workdir = re.search(r"# work folder (\S+?);", err).group(1)
    assert not Path(workdir).exists()
    assert processes_mentioning(workdir) == []
