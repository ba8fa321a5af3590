"""``trainer.keep_best``: the checkpoint of the step with the best evaluation is kept besides
``trainer.keep_checkpoints``, on disk and in the store, and only that one."""

from __future__ import annotations

import msgspec
import pytest

from streamrft.app.watch.metrics_log import read_metrics
from streamrft.consumers.checkpoint import KEEP_MARKER
from streamrft.consumers.checkpoint_store import CheckpointStore
from tests.helpers.cli import run_argv, run_ok
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e
STEPS = 6


def test_the_best_checkpoint_by_an_eval_metric_is_kept(services, make_config, tmp_path):
    run_id = f"best-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    settings = (
        "trainer.keep_best=eval/accuracy",
        "eval.interval=1",  # every step evaluated: every step may be the best
        "trainer.save_interval=0",  # no checkpoint but the best ones and the last
        "trainer.keep_checkpoints=1",
        "trainer.batch_size=8",
        "explorer.batch_size=8",
    )
    run_ok(run_argv(EXAMPLE, run_id, STEPS, runs, services, *settings), tmp_path)
    evals = {
        e.step: e.values["eval/accuracy"]
        for e in read_metrics(runs / run_id / "metrics.jsonl")
        if e.component == "trainer" and "eval/accuracy" in e.values and e.step > 0
    }
    assert sorted(evals) == list(range(1, STEPS + 1))
    best = max(evals.values())
    best_step = min(s for s, v in evals.items() if v == best)  # the first to reach it
    local = {
        p.name: (p / KEEP_MARKER).exists() for p in (runs / run_id / "checkpoints").glob("step_*")
    }
    last = f"step_{STEPS:08d}"
    kept = f"step_{best_step:08d}"
    # the newest (keep_checkpoints 1) and the best, marked; no other
    assert local == {last: best_step == STEPS, kept: True}
    cfg = make_config(run={"id": run_id})
    resolved = msgspec.structs.replace(
        cfg, object_store=msgspec.structs.replace(cfg.object_store, bucket=_bucket(runs / run_id))
    )
    stored = {step: KEEP_MARKER in m["files"] for step, m in CheckpointStore(resolved).complete()}
    assert stored[best_step] is True and stored[STEPS] == (best_step == STEPS)
    assert [s for s, marked in stored.items() if marked] == [best_step]


def _bucket(run_dir) -> str:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["object_store"]["bucket"]
