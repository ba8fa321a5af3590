"""Which weight versions a run still needs (``synchronizer.keep_versions``): pure.

Retention counts per place: a version may be announced several times, once per place it
can be read from (shared memory, the object store, a broadcast; the ``auto`` method's store
lane announces older versions than shared memory does). Each place keeps the newest
``keep`` versions announced there, so a slow place (a store lane that takes longer than
``keep`` steps per copy) still has its copies when the fast one has moved on. A version
can go once no place keeps it, it is not ``pinned`` (a transport is writing it, or wrote
it last, to a place where it is not announced yet: never retired under the writer), and
no kept version is built on it: a delta's chain back to its full version (an explorer
holding none of the chain rebuilds from there) and an adapter's base. What the trainer
then does with the answer (announce :class:`~streamrft.schemas.events.VersionsRetired`,
delete the files through its transport) is in ``consumers/trainer.py`` and
:meth:`WeightSender.retire`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from streamrft.schemas.events import ModelVersionReady

Announcements = Mapping[int, Sequence[ModelVersionReady]]
"""Every announcement of each version, by number (``ControlView.announcements``)."""


def newest_per_place(versions: Announcements, keep: int) -> set[int]:
    """The newest ``keep`` versions announced in each place (by method)."""
    places: dict[str, list[int]] = {}
    for v, events in versions.items():
        for method in {e.method for e in events}:
            places.setdefault(method, []).append(v)
    return {v for held in places.values() for v in sorted(held)[-keep:]}


def needed(versions: Announcements, keep: int, pinned: Collection[int] = ()) -> set[int]:
    """The newest ``keep`` of ``versions`` in each place, the ``pinned`` ones announced,
    and every version they are built on."""
    out: set[int] = set()
    todo = sorted(newest_per_place(versions, keep) | set(pinned)) if keep > 0 else []
    while todo:
        v = todo.pop()
        if v in out or not versions.get(v):
            continue
        out.add(v)
        for event in versions[v]:
            if event.delta_base >= 0:
                todo.append(event.delta_base)
            if event.lora and event.base_version >= 0:
                todo.append(event.base_version)
    return out


def to_retire(versions: Announcements, keep: int, pinned: Collection[int] = ()) -> list[int]:
    """The versions of ``versions`` (the announced ones not yet retired, each with its
    announcements) that can go, oldest first; none when ``keep`` is 0 (every version is
    kept). ``pinned``: versions a transport is writing or wrote last (never retired)."""
    if keep <= 0:
        return []
    return sorted(set(versions) - needed(versions, keep, pinned))
