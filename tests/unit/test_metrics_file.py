"""``metrics.jsonl`` (every metrics event of a run, outliving its broker) and ``curves.png``."""

from __future__ import annotations

import math

from streamrft.app.watch.curves import draw, series
from streamrft.app.watch.metrics_log import MetricsLog, read_metrics
from streamrft.schemas.events import MetricsEvent, TrainedGroup


def _ev(component: str, step: int, created_at: float, **values: float) -> MetricsEvent:
    return MetricsEvent(
        run="r",
        component=component,
        step=step,
        version=step,
        values=values,
        created_at=created_at,
        trained=[TrainedGroup(f"g{step}", step - 1)] if component == "trainer" else [],
    )


def test_events_round_trip_with_their_ledger_and_nan(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    sent = [
        _ev("trainer", 1, 10.0, **{"train/loss": 0.5, "train/reward_mean": 0.25}),
        _ev("explorer-0", 1, 9.0, **{"explorer/reward_mean": 0.125}),
        _ev("trainer", 2, 11.0, **{"train/loss": math.nan}),
    ]
    assert [log.append(ev) for ev in sent] == [True, True, True]
    log.close()
    back = read_metrics(path)
    assert [(e.component, e.step, e.created_at) for e in back] == [
        (e.component, e.step, e.created_at) for e in sent
    ]
    assert back[0].values == {"train/loss": 0.5, "train/reward_mean": 0.25}
    assert back[0].trained == [TrainedGroup("g1", 0)]
    assert math.isnan(back[2].values["train/loss"])


def test_a_resumed_monitor_writes_no_event_twice(tmp_path):
    """The monitor reads the topic from the beginning again after a resume: what the file
    holds is skipped, a redone step (new created_at) is kept."""
    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(path)
    first.extend([_ev("trainer", 1, 10.0, a=1.0), _ev("trainer", 2, 11.0, a=2.0)])
    first.close()
    again = MetricsLog(path)
    again.extend([_ev("trainer", 1, 10.0, a=1.0), _ev("trainer", 2, 11.0, a=2.0)])
    assert again.append(_ev("trainer", 2, 20.0, a=2.5))
    again.close()
    assert again.written == 1
    assert [(e.step, e.values["a"]) for e in read_metrics(path)] == [(1, 1.0), (2, 2.0), (2, 2.5)]


def test_a_partial_last_line_is_skipped_not_fatal(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.append(_ev("trainer", 1, 10.0, a=1.0))
    log.close()
    with path.open("ab") as fh:
        fh.write(b'{"run":"r","component":"trainer","st')  # killed mid-write
    assert [e.step for e in read_metrics(path)] == [1]
    assert "line 2: not a metrics event" in caplog.text
    resumed = MetricsLog(path)  # the run resumed: its next event is whole, on a line of its own
    resumed.append(_ev("trainer", 2, 11.0, a=2.0))
    resumed.close()
    assert [e.step for e in read_metrics(path)] == [1, 2]


def test_series_per_panel_and_component_in_step_order():
    events = [
        _ev("trainer", 2, 2.0, **{"train/reward_mean": 0.5, "train/step_seconds": 0.2}),
        _ev("trainer", 1, 1.0, **{"train/reward_mean": 0.25, "eval/accuracy": 0.1}),
        _ev("explorer-1", 1, 1.0, **{"explorer/reward_mean": 0.3, "explorer/groups": 4.0}),
        _ev("trainer", 3, 3.0, **{"train/reward_mean": math.nan}),
    ]
    s = series(events)
    assert s["reward"] == {
        "train/reward_mean": [(1, 0.25), (2, 0.5)],
        "explorer-1 explorer/reward_mean": [(1, 0.3)],
    }
    assert s["eval accuracy"] == {"eval/accuracy": [(1, 0.1)]}
    assert s["seconds per trainer step"] == {"train/step_seconds": [(2, 0.2)]}
    assert s["staleness (versions)"] == {}


def test_draw_writes_a_png_and_nothing_without_data(tmp_path):
    out = draw([_ev("trainer", 1, 1.0, **{"train/reward_mean": 0.25})], tmp_path / "c.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw([_ev("trainer", 1, 1.0, other=1.0)], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_the_file_is_read_line_by_line_and_ledgers_can_be_left_out(tmp_path):
    """A long run's file is never held whole: events come one at a time, and the curves
    and a resumed log read them without the ledgers (most of the file)."""
    import types

    from streamrft.app.watch.metrics_log import iter_metrics

    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in (1, 2):
        log.append(
            MetricsEvent(
                run="r", component="trainer", step=step, version=step, values={"a": 1.0},
                trained=[TrainedGroup(f"r/t{i}@0", step) for i in range(100)],
            )
        )  # fmt: skip
    log.close()
    events = iter_metrics(path, ledgers=False)
    assert isinstance(events, types.GeneratorType)
    light = list(events)
    assert [e.step for e in light] == [1, 2] and all(e.trained == [] for e in light)
    assert [len(e.trained) for e in iter_metrics(path)] == [100, 100]
    again = MetricsLog(path)  # a resumed log knows what the file has, and adds nothing twice
    assert not again.append(read_metrics(path)[0])
    again.close()
