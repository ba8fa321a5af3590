"""The trainer's resumable state, as stored in a checkpoint's ``state.json``.

Weights and optimizer tensors are safetensors beside it (see ``checkpoint.py``); this is
everything else a restarted trainer needs to go on where it stopped: the step, the model
version, where to resume reading each partition, the experience ids it must still
recognise as duplicates, and its running totals. msgspec JSON, no pickle.

Experience ids are remembered as 8-byte BLAKE2b digests (:func:`id_digest`), so the
dedup window costs 8 bytes per id in memory and in the file, whatever the ids look like.
Two different ids share a digest with probability 2**-64 per pair: over a run of a
billion experiences against a window of 10**5 ids, about one chance in 200,000 that one
group is dropped as a false duplicate.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

DIGEST_SIZE = 8
"""Bytes of an experience id's digest (:func:`id_digest`)."""


def id_digest(exp_id: str) -> bytes:
    """The 8-byte digest under which an experience id is remembered for deduplication."""
    return hashlib.blake2b(exp_id.encode(), digest_size=DIGEST_SIZE).digest()


class PartitionOffset(msgspec.Struct, array_like=True, frozen=True):
    """Where a restarted trainer resumes reading one partition; ``[topic, partition,
    offset]`` in JSON."""

    topic: str
    """Experience topic."""
    partition: int
    """Partition of ``topic``."""
    offset: int
    """First offset a restart reads: nothing before it is needed again."""


class TrainerState(msgspec.Struct, kw_only=True, frozen=True):
    """Everything but tensors that a resumed trainer restores (``state.json``).

    New fields go at the end with defaults, so an older checkpoint still decodes.
    """

    step: int
    """Training steps done when the checkpoint was taken."""
    version: int = -1
    """Model version the trainer had published last (-1: none yet)."""
    offsets: list[PartitionOffset] = msgspec.field(default_factory=list)
    """Per partition, the lowest offset not yet trained (or the next one when nothing is
    buffered): the restart seeks there, so the groups that were buffered are read again."""
    seen: bytes = b""
    """The dedup window: digests (:func:`id_digest`) of the most recent experience ids
    consumed, oldest first, concatenated; base64 in JSON. Ids of groups still buffered at
    the checkpoint are left out (the restart reads them again)."""
    counters: dict[str, float] = msgspec.field(default_factory=dict)
    """The trainer's running totals as its status events report them."""
    duplicates_dropped: int = 0
    """Groups dropped because one of their experience ids was already seen."""
    stale_dropped: int = 0
    """Groups dropped for being more than ``trainer.max_staleness`` versions behind."""
    trained_through: int = -1
    """Highest batch index (:attr:`ExperienceGroup.batch`) trained so far (-1: none)."""
    zero_variance_dropped: int = 0
    """Groups dropped for rewards all equal (``algorithm.dynamic_sampling``)."""
    arrived_done: dict[int, int] = msgspec.field(default_factory=dict)
    """Per batch index from ``trained_through`` on: groups that arrived and are done
    (trained, or dropped for zero variance or staleness) without being read again after
    a restart, so the restarted trainer knows a batch is complete."""

    def resume_offsets(self) -> dict[tuple[str, int], int]:
        """``{(topic, partition): offset}``: where the restart seeks each partition."""
        return {(o.topic, o.partition): o.offset for o in self.offsets}


STATE_ENCODER = msgspec.json.Encoder()
STATE_DECODER = msgspec.json.Decoder(TrainerState)


def offsets_list(offsets: dict[tuple[str, int], int]) -> list[PartitionOffset]:
    """``ExperienceBuffer.resume_offsets()`` as :attr:`TrainerState.offsets`."""
    return [PartitionOffset(t, p, o) for (t, p), o in sorted(offsets.items())]


def from_legacy(old: dict[str, Any]) -> TrainerState:
    """A ``state.json`` written before :class:`TrainerState` (a run resumed by a newer
    version): a plain dict whose ``seen`` lists the ids themselves, in sorted order.

    Raises ``msgspec.ValidationError`` when a field has the wrong type.
    """
    seen = b"".join(id_digest(i) for i in old.get("seen", []))
    fields = {k: v for k, v in old.items() if k in TrainerState.__struct_fields__}
    return msgspec.convert({**fields, "seen": seen}, TrainerState)
