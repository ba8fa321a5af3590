"""Follow a run from its event topics: progress, and the run summary at the end.

Everything here is read from ``metrics``, ``status`` and ``dead_letters`` (and ``samples``,
kept in the run folder's ``samples.jsonl``), exactly as a dashboard on another machine
would read it; the supervisor has no private channel to its children. The summary also audits the trainer's ledger ("the books"): every trained group
once, never newer than the trainer's version, never staler than ``max_staleness``.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamrft.app.watch.books import Books
from streamrft.app.watch.metric_sinks import SinkWorker
from streamrft.app.watch.run_events import read_events
from streamrft.infra.config import Config
from streamrft.infra.consume import Record
from streamrft.infra.metric_families import ComponentReport
from streamrft.schemas.events import DeadLetter, MetricsEvent, RunState, StatusEvent

log = logging.getLogger(__name__)


def _head_tail_mean(values: Sequence[float], k: int) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    k = max(1, min(k, len(values)))
    return sum(values[:k]) / k, sum(values[-k:]) / k


@dataclass
class RunMonitor:
    cfg: Config
    evaluations: dict[int, float] = field(default_factory=dict)
    """``eval/accuracy`` by the step of the weights evaluated: the trainer's own evaluation
    and the evaluators' (one of the same weights gives the same figure)."""
    train_reward: array = field(default_factory=lambda: array("d"))
    """Each step's sampled reward mean (8 bytes a step)."""
    trainer_step: int = 0
    warmup_loss: float | None = None
    """The SFT warm-up's last loss, once it is done (``trainer.warmup_sft_steps``)."""
    trainer_final: dict[str, float] = field(default_factory=dict)
    status: dict[str, StatusEvent] = field(default_factory=dict)
    reports: dict[str, ComponentReport] = field(default_factory=dict)
    """Each component's newest status and metric values, for the supervisor's ``/metrics``
    (``monitor.http_port``)."""
    dead_letters: int = 0
    undecodable: int = 0
    ledger: Books = field(init=False)
    """The trainer's ledger as the books need it (:mod:`.books`: the newest steps whole, a
    step redone after a resume replacing its lost attempt; older ones folded)."""
    sinks: list[SinkWorker] = field(default_factory=list)
    """Where every metrics event also goes as consumed (``write``, then ``flush`` after
    each poll): the run's ``metrics.jsonl`` and the exporters of ``monitor.exporters``,
    each on its own thread (``metric_sinks``), none able to stop the monitor."""
    samples: SinkWorker | None = None
    """Where every sample of the ``samples`` topic goes (the run's ``samples.jsonl``,
    ``samples_log``); None: the topic is not read."""

    def __post_init__(self) -> None:
        self.ledger = Books(self.cfg.trainer.max_staleness, self.cfg.monitor.ledger_steps)

    def on_metrics(self, ev: MetricsEvent) -> None:
        for sink in self.sinks:
            sink.write(ev)
        self.reports.setdefault(ev.component, ComponentReport()).on_metrics(ev)
        evaluator = ev.component == "trainer" or ev.component.startswith("evaluator-")
        if evaluator and "eval/accuracy" in ev.values:
            self.evaluations[ev.step] = ev.values["eval/accuracy"]
        if ev.component == "trainer":
            if "train/reward_mean" in ev.values:
                self.train_reward.append(ev.values["train/reward_mean"])
                self.trainer_step = max(self.trainer_step, ev.step)
            if "trainer/final_step" in ev.values:
                self.trainer_final = dict(ev.values)
            if "warmup/sft_loss_last" in ev.values:
                self.warmup_loss = ev.values["warmup/sft_loss_last"]
            self.ledger.add(ev)

    def progress(self) -> str:
        """The progress bar's words after its count: the newest sampled reward and
        evaluation accuracy once the trainer has stepped; before, what it is doing."""
        if self.train_reward:
            words = f"reward {self.train_reward[-1]:.2f}"
            curve = self.eval_accuracy
            return words + (f" eval_acc {curve[-1][1]:.2f}" if curve else "")
        trainer = self.status.get("trainer")
        if trainer is None:
            return "starting: the trainer builds its model"
        if trainer.detail.startswith("SFT warm-up"):
            if self.warmup_loss is None:
                return f"{trainer.detail} (supervised) before RL step 1"
            return f"SFT warm-up done (loss {self.warmup_loss:.3f}); first evaluation"
        if trainer.detail == "training":
            return "waiting for the first batch of experiences"
        return f"before step 1 ({trainer.detail or trainer.state.value})"

    def on_status(self, ev: StatusEvent) -> None:
        self.status[ev.component] = ev
        self.reports.setdefault(ev.component, ComponentReport()).on_status(ev)

    async def follow(self, stop: asyncio.Event, on_update=None) -> None:
        """Consume the event topics until ``stop`` is set and they have gone quiet (1 s);
        every metrics event also goes to each of ``sinks`` (``metrics.jsonl``, exporters),
        which are flushed after each poll."""
        handlers: dict[str, Callable[[Any], None]] = {
            "metrics": self.on_metrics,
            "status": self.on_status,
            "dead_letters": self.on_dead_letter,
        }
        samples = self.samples
        if samples is not None:
            handlers["samples"] = samples.write

        def on_bad(rec: Record) -> None:
            self.undecodable += 1
            log.warning("monitor: undecodable event on %s: %s", rec.topic, rec.error)

        def after_poll(records: list[Record]) -> None:
            if not records:
                return
            for sink in self.sinks:
                sink.flush()
            if samples is not None:
                samples.flush()
            if on_update is not None:
                on_update(self)

        await read_events(
            self.cfg.kafka,
            self.cfg.topics(),
            list(handlers),
            lambda kind, ev: handlers[kind](ev),
            follow=True,
            stop=stop,
            on_bad=on_bad,
            after_poll=after_poll,
            client_id="streamrft-monitor",
        )

    def on_dead_letter(self, _letter: DeadLetter) -> None:
        self.dead_letters += 1

    def books(self) -> tuple[dict[str, int], int]:
        """Audit of the ledger, and how many distinct groups were trained."""
        return self.ledger.audit()

    @property
    def eval_accuracy(self) -> list[tuple[int, float]]:
        """``(step, eval/accuracy)`` in step order."""
        return sorted(self.evaluations.items())

    def summary(self, wall_s: float) -> dict:
        explorers = {k: v for k, v in self.status.items() if v.role == "explorer"}
        curve = self.eval_accuracy
        acc_first = curve[0][1] if curve else None
        acc_last = curve[-1][1] if curve else None
        k = max(1, len(self.train_reward) // 10)
        r_first, r_last = _head_tail_mean(self.train_reward, k)
        trainer = self.status.get("trainer")
        counters = trainer.counters if trainer else {}
        final = self.trainer_final
        books, groups_trained = self.books()
        return {
            "run_id": self.cfg.run.id,
            "steps": self.trainer_step,
            "eval_accuracy_first": acc_first,
            "eval_accuracy_last": acc_last,
            "eval_accuracy": [[s, a] for s, a in curve],
            "mean_reward_first": r_first,
            "mean_reward_last": r_last,
            "reward_window_steps": k,
            "experiences_published": int(
                sum(e.counters.get("experiences_published", 0) for e in explorers.values())
            ),
            "groups_published": int(
                sum(e.counters.get("groups_published", 0) for e in explorers.values())
            ),
            "experiences_consumed": int(
                final.get("trainer/experiences_consumed", counters.get("experiences_consumed", 0))
            ),
            "experiences_trained": int(
                final.get("trainer/experiences_trained", counters.get("experiences_trained", 0))
            ),
            "groups_trained": groups_trained,
            "duplicates_dropped": int(final.get("trainer/duplicates_dropped", 0)),
            "stale_dropped": int(final.get("trainer/stale_dropped", 0)),
            "versions_published": int(
                final.get("trainer/versions_published", counters.get("versions_published", 0))
            ),
            "versions_applied": {
                k: int(v.counters.get("versions_applied", 0)) for k, v in sorted(explorers.items())
            },
            "versions_rejected": {
                k: int(v.counters.get("versions_rejected", 0)) for k, v in sorted(explorers.items())
            },
            "explorer_final_version": {k: v.version for k, v in sorted(explorers.items())},
            "explorers_stopped": sorted(
                k for k, v in explorers.items() if v.state == RunState.STOPPED
            ),
            "dead_letters": self.dead_letters,
            "books": books,
            "wall_s": round(wall_s, 2),
        }
