"""The one builder of experience groups for tests (valid for any tiny model's vocabulary)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from streamrft.schemas import (
    Experience,
    ExperienceGroup,
    make_group_id,
    pack_f32,
    pack_i32,
    pack_u8,
)


def make_group(
    run: str,
    task: str,
    version: int,
    n: int = 4,
    rewards: Sequence[float] | None = None,
    *,
    epoch: int = 0,
    group_id: str | None = None,
    exp_ids: Sequence[str] | None = None,
    explorer: str = "explorer-x",
    tokens: Sequence[Sequence[int]] | None = None,
    prompt_length: int = 4,
    logprobs: Sequence[Sequence[float]] | None = None,
    masks: Sequence[Sequence[int]] | None = None,
    response_text: str = "",
    infos: Sequence[dict[str, float]] | None = None,
    **fields: Any,
) -> ExperienceGroup:
    """A group of ``n`` experiences of task ``task`` sampled with model ``version``.

    By default: group id ``<run>/<task>@<epoch>``, experience ids ``<group id>#<i>``, tokens
    ``[1, 5, 6, 7, 8 + i, 2]`` (token ids below 16) of which ``prompt_length`` 4 are the
    prompt, log-probs ``[-0.5, -0.25]``, mask ``[1, 1]``, rewards alternating 0/1.

    ``exp_ids`` (which then sets ``n``), ``rewards``, ``tokens``, ``logprobs``, ``masks`` and
    ``infos`` give one value per experience; ``group_id`` replaces the group id (the experience ids follow it
    unless ``exp_ids`` is given); ``fields`` are further :class:`ExperienceGroup` fields
    (``created_at``, ``workflow``, ``explorer_step``...).
    """
    gid = make_group_id(run, task, epoch) if group_id is None else group_id
    ids = [f"{gid}#{i}" for i in range(n)] if exp_ids is None else list(exp_ids)
    n = len(ids)
    if rewards is None:
        rewards = [float(i % 2) for i in range(n)]
    if tokens is None:
        tokens = [[1, 5, 6, 7, 8 + i, 2] for i in range(n)]
    if logprobs is None:
        logprobs = [[-0.5, -0.25]] * n
    if masks is None:
        masks = [[1, 1]] * n
    experiences = [
        Experience(
            id=exp_id,
            tokens=pack_i32(tokens[i]),
            prompt_length=prompt_length,
            logprobs=pack_f32(logprobs[i]),
            action_mask=pack_u8(masks[i]),
            reward=rewards[i],
            model_version=version,
            response_text=response_text,
            info=dict(infos[i]) if infos is not None else {},
        )
        for i, exp_id in enumerate(ids)
    ]
    return ExperienceGroup(
        id=gid,
        run=run,
        task_id=task,
        explorer=explorer,
        model_version=version,
        experiences=experiences,
        epoch=epoch,
        **fields,
    )
