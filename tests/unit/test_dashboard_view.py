"""The dashboard's view of a run: events folded into the numbers the page shows."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from streamrft.app.watch.dashboard.view import MAX_POINTS, RATE_WINDOW_S, Curve, RunView
from streamrft.schemas.events import (
    DeadLetter,
    MetricsEvent,
    ModelVersionReady,
    RunState,
    Shutdown,
    StatusEvent,
)

pytestmark = pytest.mark.unit

T0 = 1_800_000_000.0


def metrics(component: str, step: int, t: float, version: int = 0, **values: float):
    values = {k.replace("__", "/"): v for k, v in values.items()}
    return MetricsEvent(
        run="r", component=component, step=step, version=version, values=values, created_at=t
    )


def status(component: str, role: str, state: RunState, t: float, step=0, version=-1, **kw):
    return StatusEvent(
        component=component,
        role=role,
        state=state,
        step=step,
        version=version,
        created_at=t,
        **kw,
    )


def version_ready(v: int, t: float) -> ModelVersionReady:
    return ModelVersionReady(
        version=v, method="object_store", uri=f"s3://b/v{v}", manifest_sha256="x", bytes=10,
        step=v, created_at=t,
    )  # fmt: skip


def test_rewards_eval_step_time_and_staleness_by_step():
    view = RunView(run="r")
    for step in (1, 2, 3):
        view.apply(
            "metrics",
            metrics(
                "trainer",
                step,
                T0 + step,
                train__reward_mean=step / 10,
                train__step_seconds=0.5 * step,
                train__staleness_groups_0=3.0,
                train__staleness_groups_1=float(step),
                **({"eval__accuracy": 0.75} if step == 2 else {}),
            ),
        )
        view.apply("metrics", metrics("explorer-0", step, T0 + step, explorer__reward_mean=0.2))
    snap = view.snapshot()
    assert snap["curves"]["reward"]["trainer"] == [[1, 0.1], [2, 0.2], [3, 0.3]]
    assert snap["curves"]["reward"]["explorer-0"] == [[1, 0.2], [2, 0.2], [3, 0.2]]
    assert snap["curves"]["eval_accuracy"] == [[2, 0.75]]
    assert snap["curves"]["step_seconds"] == [[1, 0.5], [2, 1.0], [3, 1.5]]
    assert snap["staleness"] == [[0, 9.0], [1, 6.0]]
    assert snap["trainer"]["step"] == 3
    assert snap["events"]["metrics"] == 6
    # a step redone after a resume replaces its first attempt, in the curve and the histogram
    view.apply(
        "metrics",
        metrics("trainer", 2, T0 + 9, train__reward_mean=0.9, train__staleness_groups_0=1.0),
    )
    snap = view.snapshot()
    assert snap["curves"]["reward"]["trainer"] == [[1, 0.1], [2, 0.9]]
    assert snap["staleness"] == [[0, 7.0], [1, 4.0]]
    json.dumps(snap, allow_nan=False)  # JSON-able as it is


def test_components_versions_lag_heartbeat_and_rebalances():
    view = RunView(run="r")
    view.apply("status", status("trainer", "trainer", RunState.RUNNING, T0 + 1, 4, 4))
    view.apply("control", version_ready(5, T0 + 2))
    view.apply(
        "status",
        status(
            "explorer-0", "explorer", RunState.RUNNING, T0 + 3, 6, 3,
            detail="tasks partitions 0,1", counters={"rebalances": 2.0},
        ),
    )  # fmt: skip
    # a later heartbeat without a detail keeps the partitions; an older one read late is ignored
    view.apply(
        "status",
        status("explorer-0", "explorer", RunState.WAITING_SYNC, T0 + 8, 7, 4, counters={"rebalances": 3.0}),
    )  # fmt: skip
    view.apply("status", status("explorer-0", "explorer", RunState.RUNNING, T0 + 5, 6, 3))
    view.apply("status", status("explorer-1", "explorer", RunState.STOPPED, T0 + 9, 2, 5))
    view.apply("control", Shutdown(reason="done", created_at=T0 + 10))
    snap = view.snapshot()
    rows = {r["component"]: r for r in snap["components"]}
    assert list(rows) == ["explorer-0", "explorer-1", "trainer"]
    e0 = rows["explorer-0"]
    assert (e0["state"], e0["step"], e0["version"], e0["lag"]) == ("WAITING_SYNC", 7, 4, 1)
    assert e0["heartbeat"] == T0 + 8
    # 3 assignments of tasks partitions: the first one and 2 more
    assert e0["partitions"] == "tasks partitions 0,1" and e0["rebalances"] == 2
    # a stopped explorer holds no version that could fall behind
    assert rows["explorer-1"]["state"] == "STOPPED" and rows["explorer-1"]["lag"] is None
    assert rows["trainer"]["lag"] is None
    assert snap["rebalances"] == 2
    assert snap["versions"]["announced"] == 1 and snap["versions"]["latest"] == 5
    assert snap["versions"]["recent"][0]["version"] == 5
    assert snap["shutdown"] == "done"
    assert (snap["started_at"], snap["updated_at"]) == (T0 + 1, T0 + 10)


def test_experiences_per_second_from_the_published_counters():
    view = RunView(run="r")
    # two explorers, 100 experiences/s each, heartbeats every 5 s; explorer-1 restarts at 30 s
    for t in range(0, 45, 5):
        view.apply(
            "status",
            status("explorer-0", "explorer", RunState.RUNNING, T0 + t,
                   counters={"experiences_published": 100.0 * t}),
        )  # fmt: skip
        published = 100.0 * (t if t < 30 else t - 30)
        view.apply(
            "status",
            status("explorer-1", "explorer", RunState.RUNNING, T0 + t + 0.5,
                   counters={"experiences_published": published}),
        )  # fmt: skip
    snap = view.snapshot()
    assert snap["curves"]["throughput"]["unit"] == "experiences/s"
    points = snap["curves"]["throughput"]["points"]
    # x: seconds since the first event; from 10.5 s on both explorers have a rate
    assert points[0] == [5.0, 100.0]
    assert [round(x, 1) for x, _ in points] == [
        5.0,
        5.5,
        *[t + d for t in range(10, 45, 5) for d in (0, 0.5)],
    ]
    assert all(y == pytest.approx(200.0) for x, y in points if x >= 10.5), points
    assert snap["throughput_now"] == pytest.approx(200.0)
    # a stopped explorer counts no more
    view.apply(
        "status",
        status("explorer-1", "explorer", RunState.STOPPED, T0 + 45,
               counters={"experiences_published": 1500.0}),
    )  # fmt: skip
    assert view.snapshot()["throughput_now"] == pytest.approx(100.0)


def test_groups_per_second_from_metrics_alone():
    view = RunView(run="r")
    for step in range(1, 21):
        view.apply("metrics", metrics("explorer-0", step, T0 + 2 * step, explorer__groups=32.0))
    snap = view.snapshot()
    assert snap["curves"]["throughput"]["unit"] == "groups/s"
    assert snap["throughput_now"] == pytest.approx(16.0)
    # with no status, the component comes from its metrics
    (row,) = snap["components"]
    assert (row["component"], row["role"], row["state"], row["step"]) == (
        "explorer-0",
        "explorer",
        "",
        20,
    )


def test_dead_letters_count_and_keep_the_last_ten():
    view = RunView(run="r")
    for n in range(13):
        view.apply(
            "dead_letters",
            DeadLetter(
                source_topic="streamrft.r.tasks", partition=0, offset=n, key=None,
                value=b"\xff", reason=f"bad {n} " + "x" * 1000, error_type="SchemaError",
                component="explorer-0", created_at=T0 + n,
            ),
        )  # fmt: skip
    letters = view.snapshot()["dead_letters"]
    assert letters["count"] == 13
    assert [d["offset"] for d in letters["latest"]] == list(range(3, 13))
    assert letters["latest"][-1]["source_topic"] == "streamrft.r.tasks"
    assert letters["latest"][-1]["component"] == "explorer-0"
    assert len(letters["latest"][-1]["reason"]) == 300
    assert "value" not in letters["latest"][-1]  # the bytes stay on the topic


def test_nan_values_are_left_out_and_unknown_kinds_refused():
    view = RunView(run="r")
    view.apply("metrics", metrics("trainer", 1, T0, train__reward_mean=math.nan, train__loss=1.0))
    snap = view.snapshot()
    assert snap["curves"]["reward"]["trainer"] == []
    assert snap["trainer"]["latest"] == {"train/loss": 1.0}
    with pytest.raises(ValueError, match="unknown event kind"):
        view.apply("tasks", object())


def test_a_long_curve_stays_bounded_and_keeps_its_ends():
    curve = Curve()
    n = 25 * MAX_POINTS
    for x in range(n):
        curve.add(x, float(x))
    shown = curve.shown()
    assert MAX_POINTS // 2 <= len(shown) <= MAX_POINTS + 1
    assert shown[0] == [0, 0.0] and shown[-1] == [n - 1, float(n - 1)]
    xs = [x for x, _ in shown]
    assert xs == sorted(xs)
    gaps = {b - a for a, b in itertools.pairwise(xs[:-1])}
    assert len(gaps) == 1  # evenly thinned
    assert curve.count == n


def test_rebalances_are_reassignments_of_the_explorer_that_saw_most():
    """Every member of the group counts each group rebalance, and its first assignment:
    two explorers through one rebalance are 1 rebalance, not 2 + 1."""
    view = RunView(run="r")
    rebalanced = {"explorer-0": 2.0, "explorer-1": 1.0}
    for n, (name, count) in enumerate(rebalanced.items()):
        view.apply(
            "status",
            status(name, "explorer", RunState.RUNNING, T0 + n, counters={"rebalances": count}),
        )
    snap = view.snapshot()
    assert snap["rebalances"] == 1
    assert [r["rebalances"] for r in snap["components"]] == [1, 0]
    # explorer-0 restarts and counts from 1 again: its reassignments so far stay
    view.apply(
        "status",
        status("explorer-0", "explorer", RunState.RUNNING, T0 + 9, counters={"rebalances": 1.0}),
    )
    assert view.snapshot()["rebalances"] == 1


def test_a_restarted_explorer_keeps_its_earlier_reward_curve():
    view = RunView(run="r")
    for step in range(5):
        view.apply("metrics", metrics("explorer-0", step, T0 + step, explorer__reward_mean=0.1))
    # the same component name again, counting from 0, later
    for step in range(3):
        view.apply(
            "metrics", metrics("explorer-0", step, T0 + 100 + step, explorer__reward_mean=0.5)
        )
    reward = view.snapshot()["curves"]["reward"]
    assert reward["explorer-0"] == [[s, 0.1] for s in range(5)]
    assert reward["explorer-0 (restart 1)"] == [[s, 0.5] for s in range(3)]
    # a trainer resumed from a checkpoint redoes its steps: those replace the first attempt
    view.apply("metrics", metrics("trainer", 4, T0 + 1, train__reward_mean=0.1))
    view.apply("metrics", metrics("trainer", 3, T0 + 200, train__reward_mean=0.7))
    assert view.snapshot()["curves"]["reward"]["trainer"] == [[3, 0.7]]


def test_stale_rates_leave_the_rate_now():
    """An explorer that died without STOPPED: its rate ages out of the rate now."""
    view = RunView(run="r")
    for t in range(0, 25, 5):
        view.apply(
            "status",
            status("explorer-0", "explorer", RunState.RUNNING, T0 + t,
                   counters={"experiences_published": 10.0 * t}),
        )  # fmt: skip
    assert view.snapshot(now=T0 + 21)["throughput_now"] == pytest.approx(10.0)
    assert view.snapshot(now=T0 + 20 + 2 * RATE_WINDOW_S + 1)["throughput_now"] == 0.0
    assert view.snapshot()["throughput_now"] == pytest.approx(10.0)  # the curve's newest
    assert RunView().snapshot(now=T0)["throughput_now"] is None


def test_negative_staleness_is_shown_and_any_component_reports_versions():
    view = RunView(run="r")
    view.apply(
        "metrics",
        metrics("trainer", 1, T0, version=3, train__staleness_groups_0=2.0,
                train__staleness_groups_1=1.0, **{"train__staleness_groups_-1": 4.0}),
    )  # fmt: skip
    snap = view.snapshot()
    assert snap["staleness"] == [[-1, 4.0], [0, 2.0], [1, 1.0]]
    assert snap["versions"]["latest"] == 3
    # an explorer's metrics (no reward among them) report a newer version it loaded
    view.apply("metrics", metrics("explorer-0", 7, T0 + 1, version=4, explorer__groups=2.0))
    assert view.snapshot()["versions"]["latest"] == 4


def test_the_staleness_histogram_keeps_totals_not_every_step():
    from streamrft.app.watch.dashboard.view import REDO_WINDOW_STEPS

    view = RunView(run="r")
    steps = REDO_WINDOW_STEPS * 3
    for step in range(1, steps + 1):
        view.apply("metrics", metrics("trainer", step, T0 + step, train__staleness_groups_0=2.0))
    assert len(view.staleness_by_step) == REDO_WINDOW_STEPS
    assert view.snapshot()["staleness"] == [[0, 2.0 * steps]]
    view.apply("metrics", metrics("trainer", steps, T0 + steps + 1, train__staleness_groups_0=5.0))
    assert view.snapshot()["staleness"] == [[0, 2.0 * steps + 3.0]]  # the redone step replaced


def test_evaluators_points_arriving_late_take_their_place_in_the_eval_curve():
    """Two evaluators (or the trainer and one) report steps out of order: each point goes
    where its step is, none erases the later ones; the trainer's own redo still does."""
    view = RunView(run="r")
    for component, step, acc in (
        ("evaluator-0", 0, 0.1),
        ("evaluator-0", 4, 0.5),
        ("evaluator-1", 2, 0.3),  # late: between 0 and 4
        ("evaluator-1", 4, 0.55),  # the same step again: replaces it
        ("evaluator-0", 6, 0.7),
    ):
        view.apply("metrics", metrics(component, step, T0 + step, eval__accuracy=acc))
    assert view.snapshot()["curves"]["eval_accuracy"] == [[0, 0.1], [2, 0.3], [4, 0.55], [6, 0.7]]
    view.apply("metrics", metrics("trainer", 3, T0 + 9, eval__accuracy=0.4))  # a resumed trainer
    assert view.snapshot()["curves"]["eval_accuracy"] == [[0, 0.1], [2, 0.3], [3, 0.4]]
