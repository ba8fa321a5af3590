"""Expert experiences: a task's own answer as a trained response.

One builder for every place that trains on answers rather than samples: the ``expert``
workflow (an explorer publishing expert groups, the data of the ``sft`` preset), the
trainer's expert source of the ``mix`` strategy (SFT + RL in the CHORD style), and the
SFT warm-up's rows (:func:`answer_ids`). Pure: no I/O, no model.
"""

from __future__ import annotations

import time
from typing import Any

from streamrft.infra.prompts import PromptRenderer
from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Experience, ExperienceGroup, Task, make_group_id

EXPERT_WORKFLOW = "expert"
"""The workflow name expert groups carry: the trainer trains them with the supervised
loss wherever they come from (an explorer, an application, the trainer's own source)."""


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
    response = answer_ids(render.tokenizer, task.answer)
    gid = make_group_id(run, task.id, task.epoch)
    experience = Experience(
        id=f"{gid}#0",
        tokens=pack_i32(prompt + response),
        prompt_length=len(prompt),
        logprobs=pack_f32([0.0] * len(response)),
        action_mask=pack_u8([1] * len(response)),
        reward=reward,
        model_version=version,
        response_text=task.answer,
        info={**(info or {}), "response_length": float(len(response))},
    )
    return ExperienceGroup(
        id=gid,
        run=run,
        task_id=task.id,
        explorer=source,
        model_version=version,
        experiences=[experience],
        created_at=time.time(),
        workflow=EXPERT_WORKFLOW,
        epoch=task.epoch,
    )
