"""What the policy says, for people: decoded conversations an explorer publishes on
``<ns>.samples`` (a few per step), so a dashboard or ``streamrft tail`` shows them with no
tokenizer."""

from __future__ import annotations

import math

import msgspec

from streamrft.schemas.errors import SchemaError
from streamrft.schemas.limits import check_id

SAMPLE_ROLES = ("prompt", "policy", "inserted")
"""The parts of a sample's conversation: the prompt as rendered, the policy's own tokens
(trained), and what was inserted between its turns (tool results, user turns, template
glue; not trained)."""
MAX_SAMPLE_TEXT = 2000
"""Characters a part keeps (its end is cut, and says so)."""
MAX_SAMPLE_PARTS = 64
"""Parts of one sample (a longer conversation is cut): 64 parts of 2,000 characters of 4
bytes at most stay well within an event's 1 MiB."""


class SamplePart(msgspec.Struct, kw_only=True):
    """One stretch of a sampled conversation."""

    role: str
    """``prompt``, ``policy`` or ``inserted`` (:data:`SAMPLE_ROLES`)."""
    text: str
    """The stretch decoded, special tokens shown (at most :data:`MAX_SAMPLE_TEXT`
    characters)."""


class Sample(msgspec.Struct, kw_only=True):
    """One rollout as text, published on ``<ns>.samples`` with key = task id."""

    experience_id: str
    """The experience it shows (``<group id>#<index>``)."""
    task_id: str
    """Its task."""
    explorer: str
    """The explorer that sampled it."""
    explorer_step: int
    """That explorer's step."""
    workflow: str
    """Its task's workflow."""
    model_version: int
    """The (oldest) version that sampled it."""
    reward: float
    """Its reward."""
    parts: list[SamplePart]
    """The conversation: the prompt, then policy and inserted stretches in order."""
    versions: list[int] = []
    """Every version that sampled it, oldest first, when more than one did (a partial
    rollout)."""
    info: dict[str, float] = {}
    """The experience's numbers (reward components, lengths)."""
    created_at: float = 0.0
    """Unix time it was published."""


def validate_sample(sample: Sample) -> Sample:
    """Ids of sane length, known roles, bounded text, a finite reward and time."""
    check_id(sample.experience_id, "sample: experience_id")
    where = f"sample {sample.experience_id[:200]!r}"
    for value, what in (
        (sample.task_id, "task_id"),
        (sample.explorer, "explorer"),
        (sample.workflow, "workflow"),
    ):
        check_id(value, f"{where}: {what}")
    if len(sample.parts) > MAX_SAMPLE_PARTS:
        raise SchemaError(f"{where}: {len(sample.parts)} parts, over {MAX_SAMPLE_PARTS}")
    for i, part in enumerate(sample.parts):
        if part.role not in SAMPLE_ROLES:
            raise SchemaError(f"{where}: parts[{i}].role {part.role[:40]!r} not in {SAMPLE_ROLES}")
        if len(part.text) > MAX_SAMPLE_TEXT + 100:
            raise SchemaError(f"{where}: parts[{i}] is {len(part.text)} characters")
    if not math.isfinite(sample.reward) or not math.isfinite(sample.created_at):
        raise SchemaError(f"{where}: a reward or time that is not finite")
    return sample
