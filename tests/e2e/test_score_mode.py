"""``streamrft bench`` on the checkpoints of a real short run: results in ``score.json`` and
on the run's metrics topic, the greedy mean reward equal to the trainer's own evaluation
(``eval/accuracy``) of the same steps; a run whose embedded broker has stopped still gets
its file."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import METRICS, MetricsEvent
from tests.helpers.cli import env, run_argv, run_ok, streamrft_cmd
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e

K = 4


def bench_argv(run_id: str, runs: Path, *flags: str) -> list[str]:
    return streamrft_cmd("score", str(EXAMPLE), "--run-id", run_id, "-o", f"run.dir={runs}", *flags)


def test_bench_scores_every_checkpoint_and_publishes_them(services, make_config, tmp_path):
    run_id = f"bench-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    run_ok(
        run_argv(
            EXAMPLE,
            run_id,
            2,
            runs,
            services,
            "trainer.save_interval=1",
            "eval.interval=1",
            summary=tmp_path / "summary.json",
        ),
        tmp_path,
    )
    # bench finds the run's broker in its folder (config.yaml), as `explore --run-id` does
    proc = run_ok(bench_argv(run_id, runs, "--checkpoint", "all", "--k", str(K)), tmp_path, 300)
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]) == 2

    report = json.loads((runs / run_id / "score.json").read_text())
    assert report["published"] is True and report["k"] == K and report["samples"] == K
    entries = report["checkpoints"]
    assert [e["step"] for e in entries] == [1, 2]  # one entry per checkpoint, in step order
    for e in entries:
        state = json.loads((Path(e["checkpoint"]) / "state.json").read_text())
        assert e["version"] == state["version"] >= 0
        assert e["tasks"] == 100 and e["samples"] == K and e["seconds"] > 0
        assert 0.0 <= e["greedy_accuracy"] <= 1.0 and 0.0 <= e["greedy_reward"] <= 1.0
        # exact_match: a 0/1 reward without a format bonus, so both read the same
        assert e["greedy_accuracy"] == pytest.approx(e["greedy_reward"], abs=1e-9)
        # by the estimator's math, from the same samples
        assert 0.0 <= e["pass_at_1"] <= e["pass_at_k"] <= 1.0
    assert entries[-1]["pass_at_k"] > 0  # the warmed-up model answers some tasks

    # the same weights, the same evaluator: the trainer's eval/accuracy of those steps
    trainer_eval = dict(
        map(tuple, json.loads((tmp_path / "summary.json").read_text())["eval_accuracy"])
    )
    for e in entries:
        assert e["greedy_reward"] == pytest.approx(trainer_eval[e["step"]], abs=1e-9)

    cfg = make_config(run={"id": run_id})
    published = [
        ev
        for ev in asyncio.run(read_history(cfg.kafka, cfg.topics().metrics, METRICS, "bench-test"))
        if isinstance(ev, MetricsEvent) and ev.component == "bench"
    ]
    assert [(ev.step, ev.version) for ev in published] == [
        (e["step"], e["version"]) for e in entries
    ]
    for ev, e in zip(published, entries, strict=True):
        assert ev.run == run_id
        assert ev.values["bench/greedy_reward"] == e["greedy_reward"]
        assert ev.values["bench/greedy_accuracy"] == e["greedy_accuracy"]
        assert ev.values[f"bench/pass@{K}"] == e["pass_at_k"]
        assert ev.values["bench/pass@1"] == e["pass_at_1"]


def test_a_run_whose_embedded_broker_stopped_gets_its_file_without_publishing(tmp_path):
    """The embedded broker ends with its run: bench says once that nothing was published
    and writes the file; with --require-publish it refuses before evaluating."""
    run_id = f"gone-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    fast = ("trainer.batch_size=8", "explorer.batch_size=8", "trainer.warmup_sft_steps=0")
    run_ok(run_argv(EXAMPLE, run_id, 1, runs, None, "eval.interval=0", *fast), tmp_path)

    proc = run_ok(bench_argv(run_id, runs, "--k", "2", "--samples", "3"), tmp_path, 300)
    assert "metrics not published" in proc.stderr and "Traceback" not in proc.stderr
    report = json.loads((runs / run_id / "score.json").read_text())
    assert report["published"] is False and "does not answer" in report["not_published"]
    [entry] = report["checkpoints"]
    assert entry["step"] == 1 and entry["k"] == 2 and entry["samples"] == 3

    (runs / run_id / "score.json").unlink()
    refused = subprocess.run(
        bench_argv(run_id, runs, "--require-publish"),
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "metrics cannot be published" in refused.stderr and "Traceback" not in refused.stderr
    assert not refused.stdout.strip() and not (runs / run_id / "score.json").exists()
