"""What the dashboard page shows of a run, folded from its events: pure code, no I/O.

``RunView.apply(kind, event)`` takes every event of the run's ``metrics``, ``status``,
``control`` and ``dead_letters`` topics (or only its metrics, read back from
``metrics.jsonl``), in any interleaving of the topics; ``snapshot()`` is the page's whole
state as plain JSON-able data. Curves stay bounded: past :data:`MAX_POINTS` points a curve
keeps every other one (and the newest), so a long run's snapshot stays small.

Where the numbers come from:

- reward: ``train/reward_mean`` by trainer step, ``explorer/reward_mean`` by each
  explorer's step; eval accuracy: ``eval/accuracy``; step time: ``train/step_seconds``;
- reward by explorer: an explorer whose step falls while its events get newer was
  restarted (a new process counts from 0): its new attempt is a series of its own,
  ``explorer-0 (restart 1)``, and the earlier points stay;
- staleness histogram: the sum over trainer steps of ``train/staleness_groups_<k>`` (a
  step redone after a resume replaces its first attempt); ``k < 0`` (groups sampled with a
  version newer than the one the trainer held) is shown as it is;
- experiences/s: the sum over explorers of the rise of each one's
  ``experiences_published`` status counter over its last :data:`RATE_WINDOW_S` seconds;
  with metrics only (a finished run's file), groups/s from ``explorer/groups`` over
  ``created_at``; the rate "now" leaves out sources silent for two windows;
- versions: the highest version any event reports (``ModelVersionReady``, statuses,
  metrics of any component); an explorer's lag is that minus the version it holds (none
  once it stopped);
- rebalances: the explorers' ``rebalances`` status counter counts every assignment of
  tasks partitions, the first one too, and every member counts each group rebalance: an
  explorer's reassignments are that count minus one (its largest across restarts), and the
  run's rebalances the most reassignments any one explorer saw;
- dead letters: every event of the dead-letter topic, the last :data:`LATEST_LETTERS` kept;
- samples: the decoded rollouts explorers publish, the last :data:`LATEST_SAMPLES` of each
  explorer kept (the page filters them by reward and task, and shows their text as text);
  a finished run's from its ``samples.jsonl`` (:meth:`RunView.samples_from_file`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from streamrft.schemas.events import (
    DeadLetter,
    MetricsEvent,
    ModelVersionReady,
    RunState,
    Shutdown,
    StatusEvent,
    SyncRequest,
)
from streamrft.schemas.samples import Sample

MAX_POINTS = 2000
"""Points a curve keeps before it halves its resolution."""
MAX_SERIES = 16
"""Explorer reward series drawn (more explorers: the first ones)."""
REDO_WINDOW_STEPS = 1000
"""Steps whose staleness counts a view keeps one by one, for a step redone after a resume
(always one of the last few: the trainer resumes from its newest checkpoint)."""
RATE_WINDOW_S = 20.0
"""Experiences/s is the rise of the published total over this many seconds."""
LATEST_SAMPLES = 10
"""Samples kept per explorer (the newest)."""
MAX_SAMPLE_SOURCES = 64
"""Explorers whose samples are kept (more: the first ones)."""
SAMPLES_SHOWN = 40
"""Samples a payload carries, the newest (each payload carries them whole)."""
LATEST_LETTERS = 10
"""Dead letters listed with their reason."""
LATEST_VERSIONS = 10
"""Announced versions listed."""
REASON_CHARS = 300
"""A dead letter's reason is cut to this many characters on the page."""
STALENESS_PREFIX = "train/staleness_groups_"
PARTITIONS_NOTES = ("tasks partitions", "no tasks partition")
"""Status details by which the task intake reports an assignment."""


def _role_of(values: dict[str, float]) -> str:
    """A component's role told by its metric names (when no status says it)."""
    if any(name.startswith("explorer/") for name in values):
        return "explorer"
    if any(name.startswith(("train/", "trainer/")) for name in values):
        return "trainer"
    return ""


class Curve:
    """``(x, y)`` points in x order, bounded: past :data:`MAX_POINTS` every other point is
    dropped and only every ``stride``-th new one kept; the newest is always shown. A point
    at an x not past the newest: with ``redo`` (x is a step) it replaces the points from
    there (a step redone after a resume); without (x is a time) it is left out.
    """

    def __init__(self, redo: bool = True, max_points: int = MAX_POINTS) -> None:
        self.redo = redo
        self.max_points = max_points
        self.points: list[tuple[float, float]] = []
        self.stride = 1
        self._skipped = 0
        self.newest: tuple[float, float] | None = None
        self.count = 0
        """Points ever added (finite ones)."""

    def add(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        if self.newest is not None and x <= self.newest[0]:
            if not self.redo:
                return
            self.points = [p for p in self.points if p[0] < x]
            self._skipped = 0
        self.count += 1
        self.newest = (x, y)
        self._skipped += 1
        if self._skipped < self.stride:
            return
        self._skipped = 0
        self.points.append((x, y))
        if len(self.points) > self.max_points:
            self.points = self.points[::2]
            self.stride *= 2

    def insert(self, x: float, y: float) -> None:
        """A point that may come late (of one of several sources along one x): past the
        newest it goes in by :meth:`add`; before it, put in its place (replacing one at the same
        x), nothing after it dropped."""
        if self.newest is None or x > self.newest[0]:
            self.add(x, y)
            return
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        self.count += 1
        if x == self.newest[0]:
            self.newest = (x, y)
        kept = [p for p in self.points if p[0] != x]
        at = next((i for i, p in enumerate(kept) if p[0] > x), len(kept))
        self.points = [*kept[:at], (x, y), *kept[at:]]
        if len(self.points) > self.max_points:
            self.points = self.points[::2]
            self.stride *= 2

    def shown(self) -> list[list[float]]:
        out = [[x, y] for x, y in self.points]
        if self.newest is not None and (not out or out[-1][0] != self.newest[0]):
            out.append(list(self.newest))
        return out


class Throughput:
    """The summed rate of several sources' running totals (explorers' published counts).

    Each source's rate is the rise of its total over its last :data:`RATE_WINDOW_S`
    seconds; the curve gets, at each report, the sum of the rates of the sources that
    reported within two windows and are not stopped. A total that falls is a restarted
    process counting from 0 again: its window starts over."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[str, deque[tuple[float, float]]] = {}
        self._rates: dict[str, tuple[float, float]] = {}
        """Source -> (time, rate) of its newest rate."""
        self._sums: dict[str, float] = {}
        self.curve = Curve(redo=False)

    def total(self, source: str, t: float, total: float, active: bool = True) -> None:
        """``source`` reported its running ``total`` at time ``t``."""
        seen = self._seen.setdefault(source, deque())
        if seen and total < seen[-1][1]:
            seen.clear()
        seen.append((t, total))
        while len(seen) > 1 and seen[0][0] < t - self.window_s:
            seen.popleft()
        t0, total0 = seen[0]
        if not active:
            self._rates.pop(source, None)
        elif t - t0 >= 1.0:
            self._rates[source] = (t, (total - total0) / (t - t0))
        if self._rates or not active:
            recent = [r for at, r in self._rates.values() if at >= t - 2 * self.window_s]
            self.curve.add(t, sum(recent))

    def rate_at(self, now: float) -> float | None:
        """The summed rate of the sources that reported within two windows of ``now``;
        None before any rate."""
        if not self.curve.count:
            return None
        return sum(r for at, r in self._rates.values() if at >= now - 2 * self.window_s)

    def count(self, source: str, t: float, n: float) -> None:
        """``source`` did ``n`` more at time ``t`` (a step's groups)."""
        self._sums[source] = self._sums.get(source, 0.0) + n
        self.total(source, t, self._sums[source])


@dataclass
class Component:
    """One component as its newest status (or, with metrics only, its newest metrics)."""

    name: str
    role: str = ""
    state: str = ""
    """RUNNING, REQUIRE_SYNC, WAITING_SYNC, STOPPED; empty: no status seen."""
    step: int = 0
    version: int = -1
    heartbeat: float = 0.0
    """Unix time of its newest event."""
    detail: str = ""
    partitions: str = ""
    """Its newest assignment note (``tasks partitions 0,1``)."""
    rebalances: int = 0
    """Its largest ``rebalances`` counter (assignments of tasks partitions, the first one
    too) across restarts."""
    starved: bool = False
    counters: dict[str, float] = field(default_factory=dict)


@dataclass
class RunView:
    """A run's dashboard state; see the module docstring."""

    run: str = ""
    events: dict[str, int] = field(
        default_factory=lambda: {
            "metrics": 0,
            "status": 0,
            "control": 0,
            "dead_letters": 0,
            "samples": 0,
        }
    )
    started_at: float = 0.0
    updated_at: float = 0.0
    trainer_step: int = 0
    trainer_latest: dict[str, float] = field(default_factory=dict)
    reward: dict[str, Curve] = field(default_factory=dict)
    """``trainer`` (train/reward_mean) and one per explorer (explorer/reward_mean)."""
    eval_accuracy: Curve = field(default_factory=Curve)
    step_seconds: Curve = field(default_factory=Curve)
    experiences: Throughput = field(default_factory=Throughput)
    groups: Throughput = field(default_factory=Throughput)
    staleness_by_step: dict[int, dict[int, float]] = field(default_factory=dict)
    """The counts of the newest :data:`REDO_WINDOW_STEPS` steps (a step redone after a
    resume replaces its own); :attr:`staleness` holds the totals of every step."""
    staleness: dict[int, float] = field(default_factory=dict)
    components: dict[str, Component] = field(default_factory=dict)
    attempts: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    """Explorer -> (newest step, its created_at, restarts seen) of its reward series."""
    versions_announced: int = 0
    latest_version: int = -1
    versions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=LATEST_VERSIONS))
    sync_requests: int = 0
    shutdown: str | None = None
    dead_letters: int = 0
    letters: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=LATEST_LETTERS))
    samples: dict[str, deque[dict[str, Any]]] = field(default_factory=dict)
    """Explorer -> its newest samples."""

    def apply(self, kind: str, event: Any) -> None:
        """Fold one event of topic ``kind`` (``metrics``, ``status``, ``control``,
        ``dead_letters``) into the view."""
        handlers: dict[str, Callable[[Any], None]] = {
            "metrics": self._metrics,
            "status": self._status,
            "control": self._control,
            "dead_letters": self._dead_letter,
            "samples": self._sample,
        }
        if kind not in handlers:
            raise ValueError(f"unknown event kind {kind!r}; known: {', '.join(handlers)}")
        self.events[kind] += 1
        t = float(getattr(event, "created_at", 0.0) or 0.0)
        if t > 0:
            self.started_at = t if self.started_at <= 0 else min(self.started_at, t)
            self.updated_at = max(self.updated_at, t)
        handlers[kind](event)

    # -- metrics -------------------------------------------------------------------------------
    def _metrics(self, ev: MetricsEvent) -> None:
        if ev.run and not self.run:
            self.run = ev.run
        values = ev.values
        comp = self._component(ev.component)
        if not comp.state:  # no status seen: the metrics are all there is of it
            comp.step, comp.version = ev.step, ev.version
            comp.heartbeat = max(comp.heartbeat, ev.created_at)
            comp.role = comp.role or _role_of(values)
        self.latest_version = max(self.latest_version, ev.version)
        if "train/reward_mean" in values:
            trainer = self._series("trainer")
            assert trainer is not None  # the trainer's series is never refused
            trainer.add(ev.step, values["train/reward_mean"])
            self.trainer_step = max(self.trainer_step, ev.step)
            self.trainer_latest = {k: v for k, v in values.items() if math.isfinite(v)}
        if "explorer/reward_mean" in values:
            series = self._series(self._attempt(ev.component, ev.step, ev.created_at))
            if series is not None:
                series.add(ev.step, values["explorer/reward_mean"])
        if "eval/accuracy" in values:
            if ev.component.startswith("evaluator-"):  # several, each behind the trainer
                self.eval_accuracy.insert(ev.step, values["eval/accuracy"])
            else:  # the trainer: a step redone after a resume replaces what followed
                self.eval_accuracy.add(ev.step, values["eval/accuracy"])
        if "train/step_seconds" in values:
            self.step_seconds.add(ev.step, values["train/step_seconds"])
        if "explorer/groups" in values and ev.created_at > 0:
            self.groups.count(ev.component, ev.created_at, values["explorer/groups"])
        stale = {
            int(name[len(STALENESS_PREFIX) :]): n
            for name, n in values.items()
            if name.startswith(STALENESS_PREFIX)
            and name[len(STALENESS_PREFIX) :].removeprefix("-").isdigit()
            and math.isfinite(n)
        }
        if stale:
            self._staleness(ev.step, stale)

    def _attempt(self, component: str, step: int, t: float) -> str:
        """The reward series of ``component``'s step at time ``t``: its own name, or
        ``<name> (restart N)`` once its step fell while its events got newer."""
        last_step, last_t, restarts = self.attempts.get(component, (step, t, 0))
        if step < last_step and t > last_t:
            restarts += 1
        if step >= last_step or t > last_t:
            self.attempts[component] = (step, t, restarts)
        return f"{component} (restart {restarts})" if restarts else component

    def _series(self, name: str) -> Curve | None:
        if name not in self.reward and name != "trainer" and len(self.reward) > MAX_SERIES:
            return None
        return self.reward.setdefault(name, Curve())

    def _staleness(self, step: int, counts: dict[int, float]) -> None:
        for k, n in self.staleness_by_step.get(step, {}).items():  # a redone step
            self.staleness[k] -= n
        self.staleness_by_step[step] = counts
        for k, n in counts.items():
            self.staleness[k] = self.staleness.get(k, 0.0) + n
        while len(self.staleness_by_step) > REDO_WINDOW_STEPS:  # the totals keep them
            del self.staleness_by_step[next(iter(self.staleness_by_step))]

    # -- status --------------------------------------------------------------------------------
    def _status(self, ev: StatusEvent) -> None:
        comp = self._component(ev.component)
        if ev.created_at < comp.heartbeat and comp.state:
            return  # an older heartbeat read after a newer one (another partition)
        comp.role, comp.state = ev.role, ev.state.value
        comp.step, comp.version, comp.heartbeat = ev.step, ev.version, ev.created_at
        comp.starved, comp.counters = ev.starved, dict(ev.counters)
        if ev.detail:
            comp.detail = ev.detail
            if ev.detail.startswith(PARTITIONS_NOTES):
                comp.partitions = ev.detail
        comp.rebalances = max(comp.rebalances, int(ev.counters.get("rebalances", 0)))
        if ev.role == "trainer":
            self.trainer_step = max(self.trainer_step, ev.step)
            self.latest_version = max(self.latest_version, ev.version)
        if "experiences_published" in ev.counters:
            active = ev.state != RunState.STOPPED
            self.experiences.total(
                ev.component, ev.created_at, ev.counters["experiences_published"], active
            )

    def _component(self, name: str) -> Component:
        return self.components.setdefault(name, Component(name))

    # -- control and dead letters --------------------------------------------------------------
    def _control(self, ev: Any) -> None:
        match ev:
            case ModelVersionReady():
                self.versions_announced += 1
                self.latest_version = max(self.latest_version, ev.version)
                self.versions.append(
                    {
                        "version": ev.version,
                        "step": ev.step,
                        "method": ev.method,
                        "bytes": ev.bytes,
                        "lora": ev.lora,
                        "created_at": ev.created_at,
                    }
                )
            case Shutdown():
                self.shutdown = ev.reason or "shutdown"
            case SyncRequest():
                self.sync_requests += 1

    def _dead_letter(self, ev: DeadLetter) -> None:
        self.dead_letters += 1
        self.letters.append(
            {
                "source_topic": ev.source_topic,
                "partition": ev.partition,
                "offset": ev.offset,
                "component": ev.component,
                "error_type": ev.error_type,
                "reason": ev.reason[:REASON_CHARS],
                "created_at": ev.created_at,
            }
        )

    def samples_from_file(self, samples: list[Sample]) -> None:
        """The view's samples become ``samples`` (a run's ``samples.jsonl``, read again
        whole whenever it changes), folded as events of the ``samples`` topic are."""
        self.samples = {}
        self.events["samples"] = 0
        for sample in samples:
            self.apply("samples", sample)

    def _sample(self, ev: Sample) -> None:
        kept = self.samples.get(ev.explorer)
        if kept is None:
            if len(self.samples) >= MAX_SAMPLE_SOURCES:
                return
            kept = self.samples[ev.explorer] = deque(maxlen=LATEST_SAMPLES)
        kept.append(
            {
                "explorer": ev.explorer,
                "step": ev.explorer_step,
                "task_id": ev.task_id,
                "workflow": ev.workflow,
                "version": ev.model_version,
                "versions": list(ev.versions),
                "reward": ev.reward,  # finite: the codec checked it
                "parts": [{"role": p.role, "text": p.text} for p in ev.parts],
                "created_at": ev.created_at,
            }
        )

    # -- the page's data -----------------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """Everything the page shows, as plain JSON-able data (times are Unix seconds;
        throughput x values are seconds since the run's first event). ``now``: the time
        the rate "now" is taken at (sources silent for two windows count no more); None:
        the newest point of the rate curve."""
        rates, unit = self.experiences, "experiences/s"
        if not rates.curve.count and self.groups.curve.count:
            rates, unit = self.groups, "groups/s"
        rel = [[x - self.started_at, y] for x, y in rates.curve.shown()]
        rate_now = rel[-1][1] if rel else None
        if now is not None:
            rate_now = rates.rate_at(now)
        return {
            "run": self.run,
            "events": dict(self.events),
            "started_at": self.started_at,
            "updated_at": self.updated_at,
            "trainer": {
                "step": self.trainer_step,
                "version": self.latest_version,
                "latest": self.trainer_latest,
            },
            "curves": {
                "reward": {name: c.shown() for name, c in self.reward.items()},
                "eval_accuracy": self.eval_accuracy.shown(),
                "step_seconds": self.step_seconds.shown(),
                "throughput": {"unit": unit, "points": rel},
            },
            "throughput_now": rate_now,
            "staleness": [[k, self.staleness[k]] for k in sorted(self.staleness)],
            "components": [self._row(c) for _, c in sorted(self.components.items())],
            "rebalances": max(
                (_beyond_first(c) for c in self.components.values() if c.role == "explorer"),
                default=0,
            ),
            "versions": {
                "announced": self.versions_announced,
                "latest": self.latest_version,
                "recent": list(self.versions),
            },
            "sync_requests": self.sync_requests,
            "shutdown": self.shutdown,
            "dead_letters": {"count": self.dead_letters, "latest": list(self.letters)},
            "samples": sorted(
                (x for kept in self.samples.values() for x in kept),
                key=lambda x: x["created_at"],
                reverse=True,
            )[:SAMPLES_SHOWN],
        }

    def _row(self, c: Component) -> dict[str, Any]:
        lag = None
        stopped = c.state == RunState.STOPPED.value
        if c.role in ("explorer", "serve") and c.version >= 0 and self.latest_version >= 0:
            lag = None if stopped else max(0, self.latest_version - c.version)
        return {
            "component": c.name,
            "role": c.role,
            "state": c.state,
            "step": c.step,
            "version": c.version,
            "lag": lag,
            "heartbeat": c.heartbeat,
            "detail": c.detail,
            "partitions": c.partitions,
            "rebalances": _beyond_first(c),
            "starved": c.starved,
            "experiences_published": c.counters.get("experiences_published"),
        }


def _beyond_first(c: Component) -> int:
    """Assignments of tasks partitions an explorer got after its first one."""
    return max(0, c.rebalances - 1)
