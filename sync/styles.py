"""Sync styles: when the trainer publishes and which version a batch is sampled with.

Pure functions; the explorer and trainer loops call them at every step boundary.

Versions follow the batch a task belongs to, not an explorer's own step count: the feeder
stamps every task with its global batch index *b* (its position in the run's task stream
divided by ``trainer.batch_size``), the trainer trains batch *b* at its step *b + 1* and
then holds version *b* (or the last one it published before), and whichever explorer takes
a task of batch *b* samples it as follows (*k* = ``sync_interval``):

- ``fixed``: the trainer publishes every *k* steps; batch *b* is sampled with the weights
  after trainer step ``b - b % k - sync_offset`` (rounded down to a published version,
  :func:`batch_version`), waiting for them if needed. ``sync_offset: 0`` is strictly
  on-policy; ``1`` is one-step-off asynchronous.
- ``dynamic_by_trainer``: the trainer publishes every *k* steps and marks REQUIRE_SYNC;
  explorers take the newest version at their next step boundary.
- ``dynamic_by_explorer``: every *k* explorer steps an explorer asks for a newer version
  (``SyncRequest``) and waits (WAITING_SYNC) until the trainer, at its next step boundary,
  publishes one. The trainer publishes only when asked.
- ``fully_async``: the trainer publishes every *k* steps and never waits for the rest of
  a batch (its default sample strategy is ``available``: the oldest groups that have
  arrived); an explorer takes the newest version announced at each step boundary and
  never waits for one, except for the backpressure below.

**Backpressure**, in every style: batch *b* is never sampled with a version more than
``max_staleness`` below the one the trainer will hold when it trains *b*
(:func:`staleness_floor`); an explorer that would be further ahead waits (and, under
``dynamic_by_explorer``, asks), so no group is made only to be dropped as stale. The fixed
style's :func:`batch_version` is always above that floor (the config check makes
``max_staleness >= sync_offset + sync_interval - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Style = Literal["fixed", "dynamic_by_trainer", "dynamic_by_explorer", "fully_async"]


@dataclass(frozen=True)
class Schedule:
    """The sync settings the rules read (``synchronizer.*`` and ``trainer.max_staleness``)."""

    style: Style = "fixed"
    sync_interval: int = 1
    sync_offset: int = 1
    max_staleness: int = 1


def required_version(step: int, sync_interval: int, sync_offset: int) -> int:
    """The fixed style's version for position ``step``: ``step - sync_offset`` rounded
    down to a multiple of ``sync_interval`` (the trainer publishes every interval)."""
    wanted = max(0, step - sync_offset)
    return wanted - wanted % sync_interval


def batch_version(batch: int, sync_interval: int, sync_offset: int) -> int:
    """Version the fixed style samples batch ``batch`` with: the one required at the first
    batch of its sync interval, so every batch of an interval uses the same weights."""
    return required_version(batch - batch % sync_interval, sync_interval, sync_offset)


def trainer_version_at(schedule: Schedule, batch: int) -> int:
    """Highest version the trainer can hold when it trains ``batch`` (at its step
    ``batch + 1``): the last multiple of the interval under the scheduled styles; the
    batch itself under ``dynamic_by_explorer``, whose versions come on request."""
    if schedule.style == "dynamic_by_explorer":
        return batch
    return batch - batch % schedule.sync_interval


def staleness_floor(schedule: Schedule, batch: int) -> int:
    """Lowest version ``batch`` may be sampled with and still be trained (backpressure)."""
    return max(0, trainer_version_at(schedule, batch) - schedule.max_staleness)


def is_sync_point(step: int, sync_interval: int) -> bool:
    return step % sync_interval == 0


@dataclass(frozen=True)
class ExplorerSync:
    """What an explorer does before it samples a batch."""

    request: int | None = None
    """Send a SyncRequest for a version >= this (dynamic_by_explorer)."""
    wait_for: int | None = None
    """Block until a version >= this is announced."""
    target: int | None = None
    """Apply exactly this version (fixed) when it is fresh enough; None: the newest."""
    apply: bool = True
    """Whether to apply a version at all at this boundary."""
    exact: bool = False
    """Apply ``target`` itself or nothing, however stale (an evaluator's choice)."""


def explorer_sync(schedule: Schedule, batch: int, step: int, current: int) -> ExplorerSync:
    """The plan before sampling tasks of ``batch`` at explorer step ``step`` with version
    ``current`` held (-1: none yet)."""
    floor = staleness_floor(schedule, batch)
    if schedule.style == "fixed":
        need = batch_version(batch, schedule.sync_interval, schedule.sync_offset)
        return ExplorerSync(wait_for=need, target=need, apply=need > current)
    if schedule.style in ("dynamic_by_trainer", "fully_async"):  # the newest, bar the floor
        return ExplorerSync(wait_for=floor if floor > current else None)
    if schedule.style == "dynamic_by_explorer":
        if current < 0:  # no weights yet: version 0 is always published; ask for more
            return ExplorerSync(request=floor or None, wait_for=floor)
        # at a sync point one version newer, but never one that needs this batch trained
        # (version b comes after batch b - 1): the explorer would wait on its own tasks
        asked = step > 0 and is_sync_point(step, schedule.sync_interval) and current < batch
        want = max(current + 1 if asked else -1, floor if floor > current else -1)
        if want < 0:
            return ExplorerSync(apply=False)
        return ExplorerSync(request=want, wait_for=want)
    raise ValueError(f"unknown sync style {schedule.style!r}")


def choose_version(
    announced: list[int], plan: ExplorerSync, current: int, max_staleness: int
) -> int | None:
    """The announced version to apply, or None to keep the current weights.

    A ``target`` is honoured when it is announced (or, after versions jumped on a trainer
    resume, the first one above it) and still within ``max_staleness`` of the newest;
    otherwise (the trainer ran ahead of the batch, e.g. on experiences an application
    published) the newest wins, so the experiences are not all dropped as stale.
    """
    if not plan.apply or not announced:
        return None
    if plan.exact:
        return plan.target if plan.target in announced and plan.target != current else None
    newest = max(announced)
    pick = newest
    if plan.target is not None:
        above = [v for v in announced if v >= plan.target]
        if above and newest - min(above) <= max_staleness:
            pick = min(above)
    return pick if pick > current else None


def trainer_publishes(style: Style, step: int, sync_interval: int, pending_requests: int) -> bool:
    """Whether the trainer publishes a version after finishing step ``step``."""
    if style == "dynamic_by_explorer":
        return pending_requests > 0
    return step % sync_interval == 0
