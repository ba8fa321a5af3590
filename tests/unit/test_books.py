"""The run summary's books from a bounded ledger: the same audit as keeping every event."""

import random

from streamrft.app.watch.books import Books
from streamrft.schemas.events import MetricsEvent, TrainedGroup


def _event(step: int, version: int, rows: list[tuple[str, int]]) -> MetricsEvent:
    trained = [TrainedGroup(group_id=g, model_version=v) for g, v in rows]
    return MetricsEvent(run="r", component="trainer", step=step, version=version, values={},
                        trained=trained)  # fmt: skip


def _every_event_audit(events: list[MetricsEvent], max_staleness: int) -> tuple[dict, int]:
    """What the monitor computed when it kept every step's event (a redo replaces)."""
    ledger = {ev.step: ev for ev in events if ev.trained}
    times: dict[str, int] = {}
    newer = staler = max_seen = 0
    for ev in ledger.values():
        for row in ev.trained:
            times[row.group_id] = times.get(row.group_id, 0) + 1
            stale = ev.version - row.model_version
            newer += stale < 0
            staler += stale > max_staleness
            max_seen = max(max_seen, stale)
    books = {
        "trained_twice": sum(1 for n in times.values() if n > 1),
        "newer_than_trainer": newer,
        "staler_than_max": staler,
        "max_staleness_seen": max_seen,
        "steps_in_ledger": len(ledger),
    }
    return books, len(times)


def _run(seed: int, steps: int) -> list[MetricsEvent]:
    """A trainer's stream of ledgers: some groups trained again, some stale or newer,
    and a resume that redoes the last few steps (replacing their lost attempts)."""
    rng = random.Random(seed)
    events, n = [], 0
    for step in range(1, steps + 1):
        rows = []
        for _ in range(rng.randint(0, 6)):
            n += 1
            again = n > 10 and rng.random() < 0.02
            gid = f"g{rng.randint(1, n - 1)}" if again else f"g{n}"
            rows.append((gid, step - rng.choice([0, 0, 1, 2, 5, -1])))
        events.append(_event(step, step, rows))
        if step % 97 == 0:  # a resume from three steps back: they are trained again
            for redo in range(step - 2, step + 1):
                events.append(_event(redo, redo, [(f"redo{redo}", redo)]))
    return events


def test_a_folded_ledger_audits_like_every_event_kept():
    for seed in range(3):
        events = _run(seed, 700)
        books = Books(max_staleness=2, window=50, fold=20)
        for ev in events:
            books.add(ev)
        audit, groups = books.audit()
        assert audit.pop("ledger_window_steps") < 70  # the window and one fold at most
        assert (audit, groups) == _every_event_audit(events, 2)
        assert books.folded_steps >= 500  # the comparison went through folds
        assert books.audit()[0]["trained_twice"] > 0  # and had something to find


def test_the_window_stays_bounded_however_long_the_run():
    books = Books(max_staleness=1, window=100, fold=25)
    for step in range(1, 5001):
        books.add(_event(step, step, [(f"s{step}-{i}", step) for i in range(4)]))
        assert len(books.window) < 125
    audit, groups = books.audit()
    assert groups == 20_000 and audit["steps_in_ledger"] == 5000 and audit["trained_twice"] == 0


def test_a_group_trained_again_long_after_is_still_caught():
    books = Books(max_staleness=1, window=10, fold=5)
    books.add(_event(1, 1, [("early", 1)]))
    for step in range(2, 200):
        books.add(_event(step, step, [(f"g{step}", step)]))
    books.add(_event(200, 200, [("early", 199)]))
    assert 1 in range(books.folded_newest + 1)  # step 1 was folded long before
    assert books.audit()[0]["trained_twice"] == 1
