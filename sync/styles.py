"""Sync styles: when the trainer publishes and which version an explorer step samples with.

Pure functions; the explorer and trainer loops call them at every step boundary.

- ``fixed``: the trainer publishes every ``sync_interval`` steps; explorer step ``e`` is a
  sync point when ``e % sync_interval == 0`` and samples with the weights after trainer
  step ``e - sync_offset`` (rounded down to a published version), waiting for them if
  needed. ``sync_offset: 0`` is strictly on-policy; ``1`` is one-step-off asynchronous.
- ``dynamic_by_trainer``: the trainer publishes every ``sync_interval`` steps and marks
  REQUIRE_SYNC; explorers never wait (after version 0) and take the newest version at
  their next step boundary.
- ``dynamic_by_explorer``: every ``sync_interval`` explorer steps an explorer asks for a
  newer version (``SyncRequest``) and waits (WAITING_SYNC) until the trainer, at its next
  step boundary, publishes one. The trainer publishes only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Style = Literal["fixed", "dynamic_by_trainer", "dynamic_by_explorer"]


def required_version(step: int, sync_interval: int, sync_offset: int) -> int:
    """Version explorer step ``step`` samples with under the fixed style."""
    wanted = max(0, step - sync_offset)
    return wanted - wanted % sync_interval


def is_sync_point(step: int, sync_interval: int) -> bool:
    return step % sync_interval == 0


@dataclass(frozen=True)
class ExplorerSync:
    """What an explorer does before step ``step``."""

    request: int | None = None
    """Send a SyncRequest for a version >= this (dynamic_by_explorer)."""
    wait_for: int | None = None
    """Block until a version >= this is announced."""
    target: int | None = None
    """Apply exactly this version (fixed) when it is fresh enough; None: the newest."""
    apply: bool = True
    """Whether to apply a version at all at this boundary."""


def explorer_sync(
    style: Style, step: int, current: int, sync_interval: int, sync_offset: int
) -> ExplorerSync:
    if current < 0:  # no weights yet: everyone waits for the first version
        target = required_version(step, sync_interval, sync_offset) if style == "fixed" else None
        return ExplorerSync(wait_for=target or 0, target=target)
    if style == "fixed":
        if not is_sync_point(step, sync_interval):
            return ExplorerSync(apply=False)
        need = required_version(step, sync_interval, sync_offset)
        return ExplorerSync(wait_for=need, target=need, apply=need > current)
    if style == "dynamic_by_trainer":
        return ExplorerSync()
    if style == "dynamic_by_explorer":
        if step > 0 and is_sync_point(step, sync_interval):
            return ExplorerSync(request=current + 1, wait_for=current + 1)
        return ExplorerSync(apply=False)
    raise ValueError(f"unknown sync style {style!r}")


def choose_version(
    announced: list[int], plan: ExplorerSync, current: int, max_staleness: int
) -> int | None:
    """The announced version to apply, or None to keep the current weights.

    A ``target`` is honoured when it is announced (or, after versions jumped on a trainer
    resume, the first one above it) and still within ``max_staleness`` of the newest;
    otherwise (an explorer far behind a trainer fed by many explorers) the newest wins,
    so its experiences are not all dropped as stale.
    """
    if not plan.apply or not announced:
        return None
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
