"""The evaluator role on real runs (a real broker and store, the tiny model on the CPU):
``eval.count`` under ``streamrft run`` and ``streamrft evaluate`` by hand follow the run's
versions and publish ``eval/*`` on its metrics topic; with greedy decoding their figures
equal the trainer's own evaluation of the same weights (one evaluation code, the same
batches); with an evaluator the trainer does not evaluate."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import METRICS, MetricsEvent
from tests.helpers.cli import run_argv, run_ok, service_overrides, streamrft_cmd
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e


def metrics(make_config, run_id: str) -> list[MetricsEvent]:
    cfg = make_config(run={"id": run_id})
    history = asyncio.run(read_history(cfg.kafka, cfg.topics().metrics, METRICS, "eval-test"))
    return [ev for ev in history if isinstance(ev, MetricsEvent)]


def evaluations(events: list[MetricsEvent], component: str) -> dict[int, MetricsEvent]:
    """``component``'s events that carry an evaluation, by step."""
    return {
        ev.step: ev for ev in events if ev.component == component and "eval/accuracy" in ev.values
    }


def test_an_evaluator_gives_the_trainers_figures_and_one_started_by_hand_too(
    services, make_config, tmp_path
):
    run_id = f"evaluator-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    summary = tmp_path / "summary.json"
    both = ("eval.count=1", "eval.in_trainer=true", "eval.interval=1")
    run_ok(run_argv(EXAMPLE, run_id, 3, runs, services, *both, summary=summary), tmp_path)
    events = metrics(make_config, run_id)
    trainer = evaluations(events, "trainer")
    evaluator = evaluations(events, "evaluator-0")
    assert sorted(trainer) == [0, 1, 2, 3]  # the trainer evaluated every step (in_trainer)
    # the evaluator took versions 0..3 (version v after step v), the last one at least;
    # any it passed over while behind are counted, never silently lost
    last = evaluator[max(evaluator)]
    assert max(evaluator) == 3 and set(evaluator) <= {0, 1, 2, 3}
    assert len(evaluator) + last.values["evaluator/versions_skipped"] == 4
    for step, ev in evaluator.items():
        assert ev.version == step
        assert ev.values["eval/tasks"] == 100
        for name in ("eval/accuracy", "eval/greedy_accuracy"):
            assert ev.values[name] == pytest.approx(trainer[step].values[name], abs=1e-9), (
                step,
                name,
            )
    # the run summary's curve has each step once (the same figure from either)
    curve = dict(map(tuple, json.loads(summary.read_text())["eval_accuracy"]))
    assert sorted(curve) == [0, 1, 2, 3]

    # by hand, after the run (its broker and store are the test's, still up): it finds the
    # run ended, evaluates its last version with pass@k, publishes and stops
    argv = streamrft_cmd(
        "evaluate", str(EXAMPLE), "--run-id", run_id, "-o", f"run.dir={runs}",
        "-o", "eval.pass_k=2", "-o", "eval.samples=3", *service_overrides(services),
    )  # fmt: skip
    run_ok(argv, tmp_path, 180)
    late = [
        ev
        for ev in metrics(make_config, run_id)
        if ev.component == "evaluator-0" and ev.created_at > last.created_at
    ]
    assert [ev.version for ev in late] == [3]
    values = late[0].values
    assert values["eval/accuracy"] == pytest.approx(trainer[3].values["eval/accuracy"], abs=1e-9)
    assert values["eval/samples"] == 3
    assert 0.0 <= values["eval/pass@1"] <= values["eval/pass@2"] <= 1.0


def test_with_an_evaluator_the_trainer_does_not_evaluate(services, make_config, tmp_path):
    run_id = f"offpath-{tmp_path.name[-10:]}"
    runs = tmp_path / "runs"
    summary = tmp_path / "summary.json"
    settings = ("eval.count=1", "eval.every_versions=2", "eval.interval=1")
    run_ok(run_argv(EXAMPLE, run_id, 5, runs, services, *settings, summary=summary), tmp_path)
    events = metrics(make_config, run_id)
    trainer = [ev for ev in events if ev.component == "trainer"]
    assert trainer and not [k for ev in trainer for k in ev.values if k.startswith("eval/")]
    evaluator = evaluations(events, "evaluator-0")
    versions = [ev.version for ev in evaluator.values()]
    # due: 0, 2, 4 and the last (5); in order, none twice
    assert versions == sorted(set(versions)) and set(versions) <= {0, 2, 4, 5}
    assert versions[-1] == 5
    assert len(versions) + evaluator[max(evaluator)].values["evaluator/versions_skipped"] == 4
    report = json.loads(summary.read_text())
    assert report["eval_accuracy_last"] == evaluator[max(evaluator)].values["eval/accuracy"]
    assert (runs / run_id / "logs" / "evaluator-0.log").is_file()
