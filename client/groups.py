"""Building an experience group from token lists, so an app never packs bytes by hand."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import (
    Experience,
    ExperienceGroup,
    make_group_id,
    validate_group,
)


class Rollout(NamedTuple):
    """One sampled answer to a task, as an app holds it."""

    prompt_ids: Sequence[int]
    """Token ids of the prompt (the trainer's tokenizer's ids; at least one)."""
    response_ids: Sequence[int]
    """Token ids the policy sampled (at least one)."""
    logprobs: Sequence[float]
    """Log-prob of each response token under the policy that sampled it (one per token)."""
    reward: float
    """Scalar reward of the whole response."""
    action_mask: Sequence[int] | None = None
    """One 0/1 per response token: 1 is trained, 0 (a tool result) is not; None: all 1."""
    response_text: str = ""
    """Decoded response, for people reading the topic."""


def make_group(
    run: str,
    task_id: str,
    rollouts: Iterable[Rollout | tuple | Mapping],
    model_version: int,
    explorer: str = "app",
    *,
    epoch: int = 0,
    workflow: str = "app",
) -> ExperienceGroup:
    """The experience group of ``rollouts`` (the answers to task ``task_id``), validated.

    Each rollout is a :class:`Rollout`, a tuple of its fields
    ``(prompt_ids, response_ids, logprobs, reward[, action_mask[, response_text]])`` or a
    dict of them.
    The group id is ``<run>/<task id>@<epoch>`` (a group published twice is trained
    once), the experience ids ``<group id>#<index>``; every experience is stamped with
    ``model_version``, the version that sampled it (:meth:`StreamRFTClient.latest_version`).
    ``explorer`` names the app; the group carries no batch index (trained in arrival
    order). Raises :class:`~streamrft.schemas.errors.SchemaError` naming the rollout that
    breaks a rule (lengths that differ, an empty prompt, a log-prob above 0...).
    """
    gid = make_group_id(run, task_id, epoch)
    experiences = [_experience(f"{gid}#{i}", r, model_version) for i, r in enumerate(rollouts)]
    group = ExperienceGroup(
        id=gid,
        run=run,
        task_id=task_id,
        explorer=explorer,
        model_version=model_version,
        experiences=experiences,
        created_at=time.time(),
        workflow=workflow,
        epoch=epoch,
    )
    return validate_group(group)


def _experience(exp_id: str, raw: Rollout | tuple | Mapping, version: int) -> Experience:
    try:
        rollout = Rollout(**raw) if isinstance(raw, Mapping) else Rollout(*raw)
        mask = rollout.action_mask
        return Experience(
            id=exp_id,
            tokens=pack_i32([*rollout.prompt_ids, *rollout.response_ids]),
            prompt_length=len(rollout.prompt_ids),
            logprobs=pack_f32(rollout.logprobs),
            action_mask=pack_u8([1] * len(rollout.response_ids) if mask is None else mask),
            reward=float(rollout.reward),
            model_version=version,
            response_text=rollout.response_text,
        )
    # a missing field, an id past int32, a mask value of 256
    except (OverflowError, TypeError, ValueError) as exc:
        raise SchemaError(f"experience {exp_id!r}: {exc}") from exc
