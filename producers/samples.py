"""The few rollouts of a step an explorer shows people: decoded into text on the
``samples`` topic (``explorer.samples_per_step``), for the dashboard's samples panel and
``streamrft tail --run-id ID samples``. Pure, but for the tokenizer's decoding.

A sample's conversation is cut where the experience's action mask changes: the prompt,
then the policy's own stretches (mask 1) and what was inserted between them (mask 0: tool
results, user turns, the template's glue), each decoded with its special tokens shown, so
a reader sees exactly what the model saw and said.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from streamrft.infra.produce import OutRecord
from streamrft.schemas.arrays import unpack_i32
from streamrft.schemas.codec import SAMPLE
from streamrft.schemas.experience import Experience, ExperienceGroup
from streamrft.schemas.samples import MAX_SAMPLE_PARTS, MAX_SAMPLE_TEXT, Sample, SamplePart


def cut(text: str) -> str:
    """``text``, its end cut past :data:`MAX_SAMPLE_TEXT` characters (saying how much)."""
    if len(text) <= MAX_SAMPLE_TEXT:
        return text
    return text[:MAX_SAMPLE_TEXT] + f" [... {len(text) - MAX_SAMPLE_TEXT} more characters]"


def parts_of(exp: Experience, tokenizer: Any) -> list[SamplePart]:
    """The prompt, then each run of equal mask values of the response, decoded."""
    tokens = unpack_i32(exp.tokens)
    prompt, response = tokens[: exp.prompt_length], tokens[exp.prompt_length :]
    parts = [SamplePart(role="prompt", text=cut(tokenizer.decode(prompt)))]
    start = 0
    mask = exp.action_mask
    for i in range(1, len(response) + 1):
        if i == len(response) or mask[i] != mask[start]:
            role = "policy" if mask[start] else "inserted"
            parts.append(SamplePart(role=role, text=cut(tokenizer.decode(response[start:i]))))
            start = i
    if len(parts) > MAX_SAMPLE_PARTS:
        parts = [*parts[: MAX_SAMPLE_PARTS - 1], SamplePart(role="inserted", text="[... cut]")]
    return parts


def pick_samples(
    groups: Sequence[ExperienceGroup], k: int, tokenizer: Any, seed: int
) -> list[Sample]:
    """Up to ``k`` experiences of ``groups`` (drawn with ``seed``, from as many groups as
    possible) as samples."""
    rng = random.Random(seed)
    chosen = rng.sample(list(groups), min(k, len(groups)))
    now = time.time()
    out = []
    for group in chosen:
        exp = rng.choice(group.experiences)
        out.append(
            Sample(
                experience_id=exp.id,
                task_id=group.task_id,
                explorer=group.explorer,
                explorer_step=group.explorer_step,
                workflow=group.workflow,
                model_version=exp.model_version,
                reward=exp.reward,
                parts=parts_of(exp, tokenizer),
                versions=[s.version for s in exp.segments],
                info=dict(exp.info),
                created_at=now,
            )
        )
    return out


def sample_records(topic: str, samples: Sequence[Sample]) -> list[OutRecord]:
    """Samples as records of ``topic`` (key: the task id)."""
    headers = SAMPLE.headers()
    return [OutRecord(topic, SAMPLE.encode(s), s.task_id.encode(), headers) for s in samples]
