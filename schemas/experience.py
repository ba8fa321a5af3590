"""Tasks in, experiences out: the data-plane wire types.

Schema evolution rule: new fields go at the end with a default; never reorder or retype.
Readers ignore fields they do not know, so an old reader decodes a newer writer's message.
"""

from __future__ import annotations

import itertools
import math

import msgspec

from streamrft.schemas import limits
from streamrft.schemas.arrays import unpack_f32, unpack_i32
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.limits import check_id


class ChatMessage(msgspec.Struct, kw_only=True):
    """One turn of a chat task (:attr:`Task.messages`)."""

    role: str
    """Who speaks: ``system``, ``user`` or ``assistant`` (as the model's chat template
    knows them)."""
    content: str
    """What is said."""


class Task(msgspec.Struct, kw_only=True):
    """One prompt to explore, published on ``<ns>.tasks`` with key = task id."""

    id: str
    """Stable id of the task within its taskset (e.g. ``arith-00042``)."""
    prompt: str = ""
    """The text given to the policy (empty for a chat task: see ``messages``)."""
    answer: str = ""
    """Ground truth the reward function checks against (empty for open-ended tasks)."""
    workflow: str = "math"
    """Name of the workflow that turns this task into rollouts and rewards."""
    epoch: int = 0
    """Which pass over the taskset this delivery belongs to."""
    metadata: dict[str, str] = {}
    """Free-form string attributes carried through to the experiences."""
    batch: int = -1
    """Global batch index: the task's position in the run's task stream (all epochs)
    divided by ``trainer.batch_size``, stamped by the feeder. Batch *b* is sampled with
    the version the sync style requires for *b*, whichever explorer takes it, and the
    trainer trains batches in order. -1: not stamped (an application's own task): the
    explorer's own step count stands in."""
    messages: list[ChatMessage] = []
    """A chat task: the conversation so far, used in place of ``prompt`` and rendered by
    ``taskset.format`` (the model's chat template, or the contents as raw text); empty for
    a plain-prompt task."""


class Segment(msgspec.Struct, kw_only=True):
    """Where the response tokens one model version sampled begin (a partial rollout,
    ``explorer.partial_rollout``: a long episode takes newer weights between turns)."""

    start: int
    """Offset in the response (0: its first token) of the segment's first token; the
    segment runs to the next segment's start, or to the end."""
    version: int
    """Model version that sampled the segment's policy tokens."""


class Experience(msgspec.Struct, kw_only=True):
    """One rollout: prompt + response tokens with the log-probs that sampled them."""

    id: str
    """``<group id>#<rollout index>``; the trainer deduplicates on it."""
    tokens: bytes
    """Prompt then response token ids, int32 little-endian."""
    prompt_length: int
    """How many of ``tokens`` are the prompt."""
    logprobs: bytes
    """Per response token log-prob under the sampling policy, float32 little-endian."""
    action_mask: bytes
    """Per response token 1 (trained) or 0 (ignored), one byte each."""
    reward: float
    """Scalar reward of the whole rollout."""
    model_version: int
    """Model version that produced this rollout (of a partial rollout, the oldest of its
    :attr:`segments`)."""
    response_text: str = ""
    """Decoded response, for humans reading the topic."""
    info: dict[str, float] = {}
    """Per-rollout numbers (reward components, lengths) for metrics."""
    segments: list[Segment] = []
    """A rollout sampled by more than one version (a partial rollout): its segments in
    order, the first at offset 0 with version :attr:`model_version` (the oldest, by which
    staleness counts the rollout), each next one newer. Empty: every token was sampled by
    :attr:`model_version`."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def response_length(self) -> int:
        return self.num_tokens - self.prompt_length


class ExperienceGroup(msgspec.Struct, kw_only=True):
    """The ``repeat_times`` rollouts of one task, published on ``<ns>.experiences``.

    Key = task id, so a group stays whole and group-relative advantages can be computed by
    whoever consumes it.
    """

    id: str
    """``<run>/<task id>@<epoch>``: the same for whichever explorer explores the task, so a
    task explored twice (an explorer died before committing it) is deduplicated by id."""
    run: str
    """Run id (the topic namespace) the group belongs to."""
    task_id: str
    """Id of the task the rollouts answer; also the message key."""
    explorer: str
    """Component id of the explorer that sampled it (``explorer-0``...)."""
    model_version: int
    """Oldest model version that sampled any of its rollouts (each experience's own is
    this or newer); staleness and the books count the group by it."""
    experiences: list[Experience]
    """The rollouts, ``repeat_times`` of them."""
    created_at: float = 0.0
    """Unix time the group was completed."""
    workflow: str = "math"
    """Workflow that produced it."""
    epoch: int = 0
    """Taskset pass the task was delivered in."""
    explorer_step: int = -1
    """The explorer's step that sampled it (-1: unknown, e.g. an external producer)."""
    batch: int = -1
    """Global batch index of its task (:attr:`Task.batch`); -1: none (an external
    producer, or a task that was not stamped): trained in arrival order, waiting for
    nothing."""
    kind: str = "rollouts"
    """What the experiences are: ``rollouts`` (samples of the task, trained by RL or, for
    workflow ``expert``, supervised) or ``preference`` (a chosen/rejected pair for the
    ``dpo`` algorithm: exactly 2 experiences, the chosen one first, with the same prompt
    tokens). A trainer dead-letters a preference pair unless it runs ``dpo``, and
    anything else when it does."""


GROUP_KINDS = ("rollouts", "preference")
"""The values of :attr:`ExperienceGroup.kind`."""

PREFERENCE = "preference"
"""The kind of a chosen/rejected pair (:attr:`ExperienceGroup.kind`)."""


def make_group_id(run: str, task_id: str, epoch: int) -> str:
    """One id per (task, epoch) of a run; deliberately not per explorer (see ``id``)."""
    return f"{run}/{task_id}@{epoch}"


def _where(exp_id: str) -> str:
    shown = exp_id if len(exp_id) <= 200 else exp_id[:200] + "..."
    return f"experience {shown!r}"


def validate_task(task: Task) -> Task:
    """A task has an id and a workflow name of sane length, a non-negative epoch, a
    batch index >= -1 and a role of sane length on each chat message."""
    check_id(task.id, "task id")
    check_id(task.workflow, f"task {task.id!r}: workflow")
    if task.epoch < 0:
        raise SchemaError(f"task {task.id!r}: epoch {task.epoch} < 0")
    if task.batch < -1:
        raise SchemaError(f"task {task.id!r}: batch {task.batch} < -1")
    for i, message in enumerate(task.messages):
        check_id(message.role, f"task {task.id!r}: messages[{i}].role")
    return task


_LOGPROB_SURELY_IN_RANGE = bytes(range(0x00, 0x38)) + bytes(range(0x80, 0xC2))
"""High bytes (sign and top 7 exponent bits) of the little-endian float32 log-probs that
are inside [MIN_LOGPROB, MAX_LOGPROB] whatever the other bytes: ``0x00-0x37`` is +0 to
below 2**-15 (< 1e-4), ``0x80-0xC1`` is -0 to above -32 (> -80). Log-probs whose high
bytes are all of these pass at C speed (``bytes.translate``); any other high byte (a value
near a bound, out of range, inf or NaN) sends the experience to the exact per-value check,
so the rule and its error are those of :func:`_check_logprobs` either way."""


def _check_logprobs(logprobs: bytes, where: str) -> None:
    """Every log-prob within [MIN_LOGPROB, MAX_LOGPROB]; the first that is not is named."""
    for logp in unpack_f32(logprobs):  # NaN fails both comparisons
        if not limits.MIN_LOGPROB <= logp <= limits.MAX_LOGPROB:
            raise SchemaError(
                f"{where}: log-prob {logp} outside [{limits.MIN_LOGPROB}, {limits.MAX_LOGPROB}]"
            )


def _check_experience(exp: Experience, version: int) -> None:
    check_id(exp.id, "experience id")
    where = _where(exp.id)
    if len(exp.tokens) % 4:
        raise SchemaError(f"{where}: tokens is {len(exp.tokens)} bytes, not a multiple of 4")
    if exp.num_tokens > limits.MAX_TOKENS_PER_EXPERIENCE:
        raise SchemaError(
            f"{where}: {exp.num_tokens} tokens, over {limits.MAX_TOKENS_PER_EXPERIENCE}"
        )
    n_resp = exp.response_length
    if not 0 < exp.prompt_length < exp.num_tokens:
        raise SchemaError(
            f"{where}: prompt_length {exp.prompt_length} outside (0, {exp.num_tokens})"
        )
    if len(exp.logprobs) != 4 * n_resp:
        raise SchemaError(f"{where}: logprobs is {len(exp.logprobs)} bytes, expected {4 * n_resp}")
    if len(exp.action_mask) != n_resp:
        raise SchemaError(
            f"{where}: action_mask is {len(exp.action_mask)} bytes, expected {n_resp}"
        )
    if exp.action_mask.translate(None, b"\x00\x01"):
        raise SchemaError(f"{where}: action_mask holds bytes other than 0 and 1")
    # the high byte of a little-endian int32 is >= 0x80 exactly when the id is negative
    if exp.tokens[3::4].translate(None, bytes(range(0x80))):
        raise SchemaError(f"{where}: negative token id")
    if exp.logprobs[3::4].translate(None, _LOGPROB_SURELY_IN_RANGE):
        _check_logprobs(exp.logprobs, where)  # some near or past a bound: one by one
    if not math.isfinite(exp.reward):
        raise SchemaError(f"{where}: reward {exp.reward} is not finite")
    if abs(exp.reward) > limits.MAX_ABS_REWARD:
        raise SchemaError(f"{where}: reward {exp.reward} beyond +-{limits.MAX_ABS_REWARD:g}")
    if exp.model_version < version:
        raise SchemaError(f"{where}: model_version {exp.model_version} below the group's {version}")
    if exp.segments:
        _check_segments(exp, n_resp, where)


def _check_segments(exp: Experience, n_resp: int, where: str) -> None:
    """Segments start at 0 with the experience's version, then each later in the response
    and with a newer version."""
    segments = exp.segments
    if len(segments) > limits.MAX_SEGMENTS_PER_EXPERIENCE:
        raise SchemaError(
            f"{where}: {len(segments)} segments, over {limits.MAX_SEGMENTS_PER_EXPERIENCE}"
        )
    first = segments[0]
    if first.start != 0 or first.version != exp.model_version:
        raise SchemaError(
            f"{where}: the first segment starts at {first.start} with version "
            f"{first.version}, not at 0 with model_version {exp.model_version}"
        )
    for i, (before, seg) in enumerate(itertools.pairwise(segments), start=1):
        if not before.start < seg.start < n_resp:
            raise SchemaError(
                f"{where}: segments[{i}] starts at {seg.start}, not within "
                f"({before.start}, {n_resp})"
            )
        if seg.version <= before.version:
            raise SchemaError(
                f"{where}: segments[{i}] has version {seg.version}, not newer than {before.version}"
            )


def validate_group(group: ExperienceGroup) -> ExperienceGroup:
    """Check what msgspec's typing cannot: ids, array lengths, value ranges, finite numbers.

    A group that passes can be collated and trained on without a NaN or an index error
    (token ids against the vocabulary are checked by :func:`check_token_ids`, which needs
    the model). Raises :class:`SchemaError` naming the experience and the rule it broke.
    """
    check_id(group.id, "group id")
    where = f"group {group.id!r}"
    for value, what in (
        (group.run, "run"),
        (group.task_id, "task_id"),
        (group.explorer, "explorer"),
        (group.workflow, "workflow"),
    ):
        check_id(value, f"{where}: {what}")
    if not group.experiences:
        raise SchemaError(f"{where}: no experiences")
    if len(group.experiences) > limits.MAX_EXPERIENCES_PER_GROUP:
        raise SchemaError(
            f"{where}: {len(group.experiences)} experiences, "
            f"over {limits.MAX_EXPERIENCES_PER_GROUP}"
        )
    if group.model_version < 0:
        raise SchemaError(f"{where}: model_version {group.model_version} < 0")
    if group.batch < -1:
        raise SchemaError(f"{where}: batch {group.batch} < -1")
    for exp in group.experiences:
        _check_experience(exp, group.model_version)
    if group.kind not in GROUP_KINDS:
        raise SchemaError(f"{where}: kind {group.kind[:40]!r} is not one of {GROUP_KINDS}")
    if group.kind == PREFERENCE:
        _check_pair(group, where)
    return group


def _check_pair(group: ExperienceGroup, where: str) -> None:
    """A preference pair: exactly 2 experiences (chosen, rejected) with the same prompt."""
    if len(group.experiences) != 2:
        raise SchemaError(
            f"{where}: a preference group holds exactly 2 experiences (chosen, rejected), "
            f"not {len(group.experiences)}"
        )
    chosen, rejected = group.experiences
    n = chosen.prompt_length
    if rejected.prompt_length != n or chosen.tokens[: 4 * n] != rejected.tokens[: 4 * n]:
        raise SchemaError(
            f"{where}: the chosen and rejected experiences of a preference group must have "
            "the same prompt tokens"
        )


def check_token_ids(group: ExperienceGroup, vocab_size: int) -> ExperienceGroup:
    """Every token id below ``vocab_size`` (the consumer's model); SchemaError otherwise.

    Ids are already known non-negative (:func:`validate_group`); an id past the embedding
    table would stop the trainer with an index error.
    """
    for exp in group.experiences:
        top = max(unpack_i32(exp.tokens))
        if top >= vocab_size:
            raise SchemaError(
                f"{_where(exp.id)}: token id {top} outside the model's vocabulary of {vocab_size}"
            )
    return group
