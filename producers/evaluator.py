"""The evaluator process: follows a run's versions as an explorer does and evaluates them,
off the trainer's path.

``streamrft evaluate CONFIG --run-id ID [--index I]`` (or ``eval.count`` under
``streamrft run``) loads the policy with the explorer's engine (``explorer.engine``, its
LoRA adapter when configured), then, until the run's Shutdown:
  choose the next due version among those announced (:func:`due_version`: version 0, every
  ``eval.every_versions``-th, and, after the Shutdown, the run's last; shared out between
  ``eval.count`` evaluators) -> apply it (the explorers' weight follower, every transport
  and delta included) -> evaluate it (:class:`~.evaluation.EvalSuite`: greedy reward and
  accuracy, pass@k when ``eval.pass_k``) -> one ``MetricsEvent`` (component
  ``evaluator-<i>``, step and version of the weights) on the metrics topic, where the
  dashboard, the run monitor and the exporters read it.
The trainer never waits for it: an evaluator that falls behind goes to the newest due
version and counts the ones it passed over (``evaluator/versions_skipped``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import torch

from streamrft.infra.bus import ControlView, Counters, EventSender, Position
from streamrft.infra.config import Config
from streamrft.infra.signals import install_stop_handlers
from streamrft.producers.evaluation import EvalSuite
from streamrft.producers.policy import followed_policy, start_sampler
from streamrft.schemas.errors import ConfigError, RewardServiceError, SyncError, SyncTimeout
from streamrft.schemas.events import RunState

log = logging.getLogger(__name__)

RETRY_S = 2.0
"""Pause before choosing again when the chosen version could not be applied (a store
that is down: the follower stays on the weights it holds)."""


def turn(version: int, every: int) -> int:
    """The evaluation turn ``version`` falls in: ``ceil(version / every)``."""
    return -(-version // every)


def due_version(
    announced: Iterable[int],
    done: int,
    every: int,
    index: int = 0,
    group: int = 1,
    final: bool = False,
) -> tuple[int | None, int]:
    """(the version evaluator ``index`` of ``group`` evaluates next, the due versions of its
    own it passes over to get there). Due: version 0, each multiple of ``every`` and, once
    the run has ended (``final``), its last version; evaluator ``i`` takes the due versions
    whose :func:`turn` is ``i`` modulo ``group``. Of its own due versions above ``done``
    (the newest it evaluated) it takes the newest: (None, 0) when there is none."""
    newer = sorted(v for v in announced if v > done)
    last = newer[-1] if final and newer else None
    mine = [v for v in newer if (v % every == 0 or v == last) and turn(v, every) % group == index]
    if not mine:
        return None, 0
    return mine[-1], len(mine) - 1


class Evaluator:
    """``attempt_started_at``: the Unix time the run's attempt this evaluator serves began
    (``streamrft run`` passes it; a restarted evaluator keeps it): a Shutdown after it ends
    the evaluator, an earlier one is from a previous attempt. None (by hand): a Shutdown
    after this process started ends it, and a run that had ended before is taken as ended
    (its last version is evaluated)."""

    def __init__(
        self, cfg: Config, index: int = 0, attempt_started_at: float | None = None
    ) -> None:
        from streamrft.producers.engines import check_engine

        self.cfg = cfg
        self.index = index
        self.attempt_started_at = attempt_started_at
        check_engine(cfg.explorer.engine, "eval.engine" if cfg.eval.engine else "explorer.engine")
        if cfg.synchronizer.method == "nccl":
            raise ConfigError(
                "synchronizer.method nccl broadcasts versions to the explorers only: an "
                "evaluator cannot follow them; use auto or object_store"
            )
        self.group = max(1, cfg.eval.count)
        if index >= self.group:
            raise ConfigError(
                f"--index {index}: the run has eval.count {cfg.eval.count} evaluator(s), "
                f"numbered 0 to {self.group - 1}"
            )
        self.name = f"evaluator-{index}"
        self.stop = asyncio.Event()
        self.done = -1
        """The newest version evaluated."""
        self.step = 0
        """The trainer step of the weights held."""
        self.counters = Counters()
        self.events = EventSender(cfg, self.name, "evaluator", self.counters, self._position)
        self.view = ControlView(cfg, self.name, self.events.dead_letter)
        if attempt_started_at is not None:
            self.view.shutdowns_from = attempt_started_at
        torch.set_num_threads(cfg.explorer.threads)
        policy = followed_policy(cfg, self.name, self.view, self.events, self.counters, self.stop)
        self.engine, self.prompts, self.follower = policy.engine, policy.prompts, policy.follower
        self.suite = EvalSuite(cfg)
        log.info(
            "%s: %d eval tasks, every %d-th version (one of %d evaluators)%s",
            self.name,
            len(self.suite.tasks),
            cfg.eval.every_versions,
            self.group,
            f", pass@{cfg.eval.pass_k} of {cfg.eval.sample_count}" if cfg.eval.pass_k else "",
        )

    def _position(self) -> Position:
        held = self.follower.version
        return Position(step=self.step, version=held, ready=held >= 0)

    def _ended(self) -> bool:
        """The run's Shutdown came, or the run had ended before this process started (an
        evaluator started on a finished run evaluates its last version, then stops)."""
        return self.view.shutdown.is_set() or (
            self.attempt_started_at is None
            and self.view.caught_up.is_set()
            and self.view.ended_before
        )

    def _next(self) -> tuple[int | None, int]:
        return due_version(
            self.follower.usable(),
            self.done,
            self.cfg.eval.every_versions,
            self.index,
            self.group,
            final=self._ended(),
        )

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        install_stop_handlers(self.stop, self.name)
        async with contextlib.AsyncExitStack() as stack:  # stops what started, in reverse
            await start_sampler(
                stack, self.cfg, self.name, self.events, self.view, self.follower, data=False
            )
            await self.follower.remember_rejections()
            await self.events.status(RunState.RUNNING, "started")
            await self._loop()

    async def _loop(self) -> None:
        """Evaluate due versions until the run's Shutdown; then its last one (when it is
        this evaluator's), and stop. After the run has ended, a version that cannot be
        loaded for ``synchronizer.sync_timeout`` (a store that is down) is an error: nothing
        newer will come."""
        failing_since: float | None = None
        while not self.stop.is_set():
            self.view.check()
            ended = self._ended()
            version, skipped = self._next()
            if version is None:
                if ended:
                    return
                with contextlib.suppress(SyncTimeout):  # no version for a while: wait on
                    await self.view.wait_until(
                        lambda: self._next()[0] is not None or self._ended(),
                        30.0,
                        self.stop,
                        "a new version",
                    )
                continue
            event = self.view.versions.get(version)  # retired meanwhile: gone from the view
            applied = await self.follower.apply_version(version)
            if not applied and self.stop.is_set():
                return
            if self.follower.version != version or event is None:  # choose again soon
                failing_since = failing_since or time.monotonic()
                waited = time.monotonic() - failing_since
                if ended and waited > self.cfg.synchronizer.sync_timeout:
                    raise SyncError(
                        f"{self.name}: version {version} of the ended run could not be loaded "
                        f"within synchronizer.sync_timeout ({waited:.0f} s); see the log"
                    )
                await asyncio.sleep(RETRY_S)
                continue
            failing_since = None
            if skipped:
                self.counters.add("versions_skipped", skipped)
                log.warning(
                    "%s: %d due version(s) passed over to evaluate version %d (started after "
                    "them, or evaluating is slower than training: then raise "
                    "eval.every_versions or eval.count)",
                    self.name,
                    skipped,
                    version,
                )
            await self.evaluate(version, event.step)

    async def evaluate(self, version: int, step: int) -> None:
        """Evaluate the weights held (``version``, taken after trainer step ``step``) and
        publish the result."""
        self.step = step
        await self.events.status(RunState.RUNNING, f"evaluating version {version}")
        e = self.cfg.eval
        try:
            result = await asyncio.to_thread(
                self.suite.measure, self.engine, self.prompts, e.pass_k, e.sample_count
            )
        except RewardServiceError as exc:  # a judge down: this version goes unevaluated
            self.done = version
            self.counters.add("evaluations_failed")
            log.warning("%s: version %d not evaluated: %s", self.name, version, exc)
            await self.events.status(RunState.RUNNING, f"version {version} not evaluated: {exc}")
            return
        self.done = version
        self.counters.add("versions_evaluated")
        values = result.metrics()
        values["evaluator/versions_skipped"] = float(self.counters.get("versions_skipped"))
        await self.events.metrics(values)
        await self.events.status(RunState.RUNNING, f"evaluated version {version}")
        log.info(
            "%s: version %d (step %d): %s",
            self.name,
            version,
            step,
            ", ".join(f"{k} {v:.3f}" for k, v in values.items() if k.startswith("eval/")),
        )


def main(cfg: Config, index: int = 0, attempt_started_at: float | None = None) -> None:
    asyncio.run(Evaluator(cfg, index, attempt_started_at).run())
