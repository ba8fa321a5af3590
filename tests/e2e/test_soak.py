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
    for mark in marks:
        # complete in the store: the newest versions, one retired a step ago (deleted after
        # the next step) and one just written; the newest checkpoints and one just uploaded
        assert 1 <= mark["store_versions"] <= KEEP_VERSIONS + 2, mark
        assert 1 <= mark["store_checkpoints"] <= KEEP_CHECKPOINTS + 1, mark
        # complete on disk: the newest checkpoints and one just saved, the oldest not yet pruned
        assert 1 <= mark["checkpoints_kept"] <= KEEP_CHECKPOINTS + 1, mark
        # on their way: on disk a checkpoint being written, one uploading and one waiting to;
        # in the store a version and a checkpoint being written and one of each being deleted
        assert mark["checkpoints_on_way_mb"] <= 3 * mark["checkpoint_mb"], mark
        one_each = mark["store_version_mb"] + mark["store_checkpoint_mb"]
        assert mark["store_on_way_mb"] <= 2 * one_each, mark
    # bytes that do not grow with the run: each version and checkpoint the same size from
    # step 100 to 200, and as many of them as the bounds above (a store or checkpoints folder
    # that kept everything would hold 5 to 10 times more at step 200)
    for figure in ("checkpoint_mb", "store_version_mb", "store_checkpoint_mb"):
        first, last = marks[0][figure], marks[-1][figure]
        assert first > 0 and 2 / 3 <= last / first <= 1.5, (figure, first, last)
    for mark in marks:
        disk = (KEEP_CHECKPOINTS + 1) * mark["checkpoint_mb"] + mark["checkpoints_on_way_mb"]
        assert mark["checkpoints_mb"] <= disk + 0.05, mark  # + ``latest``, and rounding
        store = (
            (KEEP_VERSIONS + 2) * mark["store_version_mb"]
            + (KEEP_CHECKPOINTS + 1) * mark["store_checkpoint_mb"]
            + mark["store_on_way_mb"]
        )
        assert mark["store_mb"] <= store + 0.05, mark  # + the run's record, and rounding
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
