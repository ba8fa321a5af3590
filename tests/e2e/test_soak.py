"""The CI variant of ``bench/soak.py``: a 200-step run of the default example, a version
after every step, with the bounded structures made small enough to fill; their sizes are
asserted, never RSS or times (the 2,000-step figures are in docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.cli import env
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.e2e

KEEP_VERSIONS = 4
LEDGER_STEPS = 40
KEEP_CHECKPOINTS = 2


def test_a_long_run_keeps_what_it_holds_bounded(tmp_path):
    argv = [
        sys.executable, str(ROOT / "bench" / "soak.py"),
        "--steps", "200", "--marks", "100,150,200", "--dir", str(tmp_path),
        "--keep-versions", str(KEEP_VERSIONS),
        "-o", f"monitor.ledger_steps={LEDGER_STEPS}",
        "-o", "trainer.save_interval=20",
        "-o", f"trainer.keep_checkpoints={KEEP_CHECKPOINTS}",
        "-o", "monitor.exporters=[]",
    ]  # fmt: skip
    done = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    marks, final = result["marks"], result["final"]
    assert [m["step"] for m in marks] == [100, 150, 200]
    for mark in marks:  # the newest, one retired a step ago (deleted after the next step)
        assert 1 <= mark["store_versions"] <= KEEP_VERSIONS + 2, mark  # and one on its way
        # checkpoints in the store: the newest kept ones (one may be on its way)
        assert 1 <= mark["store_checkpoints"] <= KEEP_CHECKPOINTS + 1, mark
    # bytes that do not grow with the run: from step 100 to 200 a store or checkpoints folder
    # that kept everything would double; a bounded one moves only with what is on its way
    # (4 to 6 versions, a checkpoint being written)
    for figure in ("store_mb", "checkpoints_mb"):
        first, last = marks[0][figure], marks[-1][figure]
        assert first > 0 and 2 / 3 <= last / first <= 1.5, (figure, first, last)
    checkpoints = list(tmp_path.glob("soak-*/checkpoints/step_*"))
    assert 1 <= len(checkpoints) <= KEEP_CHECKPOINTS, checkpoints
    # the supervisor's ledger: the newest steps whole (and one fold's worth), the rest
    # folded, and the books still whole
    assert final["ledger_window_steps"] <= LEDGER_STEPS + LEDGER_STEPS // 4
    assert final["steps_in_ledger"] >= 200 and final["trained_twice"] == 0
    # the trainer's control view: retired versions forgotten, no request piling up
    assert final["view_versions"] <= KEEP_VERSIONS + 1
    assert final["view_announcements"] <= KEEP_VERSIONS + 1
    assert final["view_requests"] <= 1 and final["view_peers"] <= 4
    assert final["view_retired"] >= 200 - KEEP_VERSIONS - 1  # what is still kept per version
