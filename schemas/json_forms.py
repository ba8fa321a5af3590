"""The JSON form of the data-plane types, for applications that do not speak msgpack.

A message on ``tasks`` or ``experiences`` whose ``content-type`` header is
``application/json`` (:data:`JSON_CONTENT_TYPE`) is JSON; without that header (or with
``application/msgpack``) it is msgpack. A task's JSON form is the :class:`Task` itself. An
experience group's JSON form differs from the wire type only where the wire packs arrays
into bytes: in JSON, ``tokens``, ``logprobs`` and ``action_mask`` are plain number arrays
(:class:`ExperienceJSON`), so an app in any language writes them from the JSON Schema
(``schemas/json/``, ``python -m tools.schemagen``) with no byte packing. Both forms decode
to the same value and pass the same validation.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8, unpack_f32, unpack_i32
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import Experience, ExperienceGroup, Segment

JSON_CONTENT_TYPE = "application/json"
MSGPACK_CONTENT_TYPE = "application/msgpack"
HEADER_CONTENT_TYPE = "content-type"

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
MaskBit = Annotated[int, msgspec.Meta(ge=0, le=1)]


class ExperienceJSON(msgspec.Struct, kw_only=True):
    """One rollout in JSON: :class:`~streamrft.schemas.experience.Experience` with its
    arrays as number arrays."""

    id: str
    """``<group id>#<rollout index>``; the trainer deduplicates on it."""
    tokens: list[TokenId]
    """Prompt then response token ids (the trainer's tokenizer's ids)."""
    prompt_length: int
    """How many of ``tokens`` are the prompt (at least 1, fewer than all)."""
    logprobs: list[float]
    """One log-prob per response token under the policy that sampled it (<= 0)."""
    action_mask: list[MaskBit]
    """One 0/1 per response token: 1 is trained, 0 (a tool result, a user turn) is not."""
    reward: float
    """Scalar reward of the whole rollout."""
    model_version: int
    """Model version that produced this rollout (the group's ``model_version`` or newer;
    of a partial rollout, the oldest of its ``segments``)."""
    response_text: str = ""
    """Decoded response, for humans reading the topic."""
    info: dict[str, float] = {}
    """Per-rollout numbers (reward components, lengths) for metrics."""
    segments: list[Segment] = []
    """A rollout sampled by several versions: where each version's tokens begin in the
    response, oldest first (empty: all by ``model_version``)."""


class ExperienceGroupJSON(msgspec.Struct, kw_only=True):
    """An experience group in JSON: the rollouts of one task (see
    :class:`~streamrft.schemas.experience.ExperienceGroup`, whose fields and rules it shares)."""

    id: str
    """Unique per (run, task, epoch), e.g. ``<run>/<task id>@<epoch>``; a group sent twice is
    trained once."""
    run: str
    """Run id (the topic namespace) the group belongs to."""
    task_id: str
    """Id of the task the rollouts answer; also the message key."""
    explorer: str
    """Who sampled it (an app's own name)."""
    model_version: int
    """Oldest model version that sampled any of its rollouts (>= 0)."""
    experiences: list[ExperienceJSON]
    """The rollouts (1 to 1024)."""
    created_at: float = 0.0
    """Unix time the group was completed."""
    workflow: str = "math"
    """Workflow (or app) that produced it."""
    epoch: int = 0
    """Taskset pass the task was delivered in."""
    explorer_step: int = -1
    """The producer's step (-1: unknown)."""
    batch: int = -1
    """Global batch index of its task; -1 (an app's own group): trained in arrival order."""
    kind: str = "rollouts"
    """``rollouts`` or ``preference`` (a chosen/rejected pair for ``dpo``)."""


def group_from_json(form: ExperienceGroupJSON) -> ExperienceGroup:
    """The wire group of a JSON form (number arrays packed; float32 log-probs)."""
    try:
        experiences = [
            Experience(
                **{
                    **msgspec.structs.asdict(e),
                    "tokens": pack_i32(e.tokens),
                    "logprobs": pack_f32(e.logprobs),
                    "action_mask": pack_u8(e.action_mask),
                }
            )
            for e in form.experiences
        ]
    except OverflowError as exc:  # a log-prob beyond float32
        raise SchemaError(f"experience_group: {exc}") from exc
    return ExperienceGroup(**{**msgspec.structs.asdict(form), "experiences": experiences})


def group_to_json(group: ExperienceGroup) -> ExperienceGroupJSON:
    """The JSON form of a wire group (arrays unpacked)."""
    experiences = [
        ExperienceJSON(
            **{
                **msgspec.structs.asdict(e),
                "tokens": unpack_i32(e.tokens),
                "logprobs": unpack_f32(e.logprobs),
                "action_mask": list(e.action_mask),
            }
        )
        for e in group.experiences
    ]
    return ExperienceGroupJSON(**{**msgspec.structs.asdict(group), "experiences": experiences})
