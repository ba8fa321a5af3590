"""Expert experiences: a task's own answer as a trained response.

One builder for every place that trains on answers rather than samples: the ``expert``
workflow (an explorer publishing expert groups, the data of the ``sft`` preset), the
trainer's expert source of the ``mix`` strategy (SFT + RL in the CHORD style), the SFT
warm-up's rows (:func:`answer_ids`), and the ``preference`` workflow's chosen/rejected
pairs (:func:`preference_group`, the data of the ``dpo`` preset). Pure: no I/O, no model.
"""

from __future__ import annotations

import time
from typing import Any

from streamrft.infra.prompts import PromptRenderer
from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import (
    GROUP_KINDS,
    PREFERENCE,
    Experience,
    ExperienceGroup,
    Task,
    make_group_id,
)

EXPERT_WORKFLOW = "expert"
"""The workflow name expert groups carry: the trainer trains them with the supervised
loss wherever they come from (an explorer, an application, the trainer's own source)."""

PREFERENCE_WORKFLOW = "preference"
"""The workflow name of chosen/rejected pairs (:func:`preference_group`)."""

REJECTED_KEY = "rejected"
"""The task metadata key of a preference task's rejected answer (``answer``: the chosen)."""


def answer_ids(tokenizer: Any, answer: str) -> list[int]:
    """The token ids of ``answer`` (no special tokens) followed by EOS."""
    return [*tokenizer(answer, add_special_tokens=False).input_ids, tokenizer.eos_token_id]


def expert_group(
    task: Task,
    render: PromptRenderer,
    *,
    run: str,
    source: str,
    version: int,
    reward: float = 1.0,
    info: dict[str, float] | None = None,
) -> ExperienceGroup:
    """A group of one experience: the task's prompt as ``render`` renders it, then its
    answer and EOS, every response token trained, log-probs 0 (the expert is not the
    policy: no ratio may be taken on it). ``source``: the component that made it."""
    if not task.answer:
        raise ConfigError(f"task {task.id!r}: an expert experience needs the task's answer")
    prompt = render.ids(task)
    gid = make_group_id(run, task.id, task.epoch)
    experience = answer_experience(
        f"{gid}#0", prompt, render.tokenizer, task.answer, reward, version, info
    )
    return _group(task, gid, run, source, version, [experience], EXPERT_WORKFLOW)


def preference_group(
    task: Task, render: PromptRenderer, *, run: str, source: str, version: int
) -> ExperienceGroup:
    """A chosen/rejected pair (kind ``preference``): the task's prompt as ``render``
    renders it, then its ``answer`` (chosen, reward 1) or its ``metadata["rejected"]``
    (rejected, reward 0), each with EOS, every response token trained, log-probs 0."""
    rejected = task.metadata.get(REJECTED_KEY, "")
    if not task.answer or not rejected:
        raise ConfigError(
            f"task {task.id!r}: a preference pair needs the task's answer (chosen) and "
            f"metadata[{REJECTED_KEY!r}] (rejected)"
        )
    prompt = render.ids(task)
    gid = make_group_id(run, task.id, task.epoch)
    pair = [
        answer_experience(f"{gid}#{i}", prompt, render.tokenizer, text, reward, version)
        for i, (text, reward) in enumerate(((task.answer, 1.0), (rejected, 0.0)))
    ]
    return _group(task, gid, run, source, version, pair, PREFERENCE_WORKFLOW, PREFERENCE)


def _group(
    task: Task,
    gid: str,
    run: str,
    source: str,
    version: int,
    experiences: list[Experience],
    workflow: str,
    kind: str = GROUP_KINDS[0],
) -> ExperienceGroup:
    """The group of ``task``'s ``experiences``, made by ``source`` now."""
    return ExperienceGroup(
        id=gid,
        run=run,
        task_id=task.id,
        explorer=source,
        model_version=version,
        experiences=experiences,
        created_at=time.time(),
        workflow=workflow,
        epoch=task.epoch,
        kind=kind,
    )


def answer_experience(
    eid: str,
    prompt: list[int],
    tokenizer: Any,
    answer: str,
    reward: float,
    version: int,
    info: dict[str, float] | None = None,
) -> Experience:
    """``prompt`` then ``answer`` and EOS as one experience: every response token trained,
    log-probs 0 (not the policy's sample: no ratio may be taken on it)."""
    response = answer_ids(tokenizer, answer)
    return Experience(
        id=eid,
        tokens=pack_i32(prompt + response),
        prompt_length=len(prompt),
        logprobs=pack_f32([0.0] * len(response)),
        action_mask=pack_u8([1] * len(response)),
        reward=reward,
        model_version=version,
        response_text=answer,
        info={**(info or {}), "response_length": float(len(response))},
    )
