"""Which weight versions a run still needs (``synchronizer.keep_versions``): pure.

A version can go once it is neither among the newest ``keep`` announced nor something one of
those is built on: a delta's chain back to its full version (an explorer holding none of
the chain rebuilds from there) and an adapter's base. What the trainer then does with the
answer (announce :class:`~streamrft.schemas.events.VersionsRetired`, delete the files
through its transport) is in ``consumers/trainer.py`` and :meth:`WeightSender.retire`.
"""

from __future__ import annotations

from collections.abc import Mapping

from streamrft.schemas.events import ModelVersionReady


def needed(versions: Mapping[int, ModelVersionReady], keep: int) -> set[int]:
    """The newest ``keep`` of ``versions`` and every version they are built on."""
    out: set[int] = set()
    todo = sorted(versions)[-keep:] if keep > 0 else []
    while todo:
        v = todo.pop()
        if v in out or v not in versions:
            continue
        out.add(v)
        event = versions[v]
        if event.delta_base >= 0:
            todo.append(event.delta_base)
        if event.lora and event.base_version >= 0:
            todo.append(event.base_version)
    return out


def to_retire(versions: Mapping[int, ModelVersionReady], keep: int) -> list[int]:
    """The versions of ``versions`` (the announced ones not yet retired) that can go, oldest
    first; none when ``keep`` is 0 (every version is kept)."""
    if keep <= 0:
        return []
    return sorted(set(versions) - needed(versions, keep))
