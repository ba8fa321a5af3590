"""Bounds every decoder enforces, so that no message can make a reader allocate or compute
without limit, or feed the trainer numbers that turn its loss into NaN.

The byte limits are checked before a message is decoded; the others by the validators of
:mod:`streamrft.schemas.experience` and :mod:`streamrft.schemas.events`.
"""

from __future__ import annotations

from streamrft.schemas.errors import SchemaError

MiB = 1 << 20

# -- message sizes (bytes of the Kafka value), checked before decoding -----------------------
DATA_MAX_BYTES = 16 * MiB
"""Experience groups and dead letters: the default ``kafka.max_request_bytes``."""
TASK_MAX_BYTES = 1 * MiB
"""One task: a prompt, its answer and a few metadata strings."""
EVENT_MAX_BYTES = 1 * MiB
"""Control and status events: a few short strings and numbers."""
RECORD_MARGIN_BYTES = 64 << 10
"""Room the run's own producers leave beside a record's value in a produce request (key,
headers, framing): a value they send is at most ``min(kafka.max_request_bytes, the
topic's limit)`` minus this."""
DEAD_LETTER_MARGIN_BYTES = 32 << 10
"""Room a dead letter keeps for its own fields (a reason of at most 2,000 characters, topic
and component names) and the record around it. Smaller than :data:`RECORD_MARGIN_BYTES` by
more than the longest key (:data:`MAX_ID_CHARS` characters, 4 bytes each at most), so a
record the run's own producers sent always fits a dead letter with its bytes."""
METRICS_MAX_BYTES = 4 * MiB
"""Metrics carry the trainer's ledger: one ``[group id, version]`` row (~60-200 bytes) per
trained group, so 4 MiB holds a step of 20,000+ groups."""

# -- structure -------------------------------------------------------------------------------
MAX_ID_CHARS = 1024
"""Ids and names (group, experience, task, run, component, workflow)."""
MAX_URI_CHARS = 4096
"""``ModelVersionReady.uri``."""
MAX_RUN_FILES = 256
"""Task files a run's record fingerprints at most (``RunDefined``)."""
MAX_RUN_RECORD_CHARS = 512 * 1024
"""A run's record (``RunDefined``: its config and fingerprints): well within one event."""
MAX_EXPERIENCES_PER_GROUP = 1024
"""Same bound as ``explorer.repeat_times``."""
MAX_TOKENS_PER_EXPERIENCE = 1 << 18
"""Prompt + response tokens of one rollout (262,144: beyond any context window in use)."""
MAX_SEGMENTS_PER_EXPERIENCE = 1024
"""Version segments of one rollout (:attr:`~.experience.Experience.segments`): a segment
starts at a policy turn, and no episode runs a thousand turns."""
MAX_RETIRED_PER_EVENT = 100_000
"""Versions one ``VersionsRetired`` names (a run retires a few at a time)."""
MAX_REJECTIONS_REPORTED = 64
"""Refused version announcements a status event carries (the newest; see ``Rejection``)."""
MAX_ABS_REWARD = 1e6
"""A reward beyond this overflows float32 statistics of a group (its std) into inf/NaN."""
MIN_LOGPROB = -80.0
"""A sampled token's log-prob below this (p < 2e-35) cannot come from float32 sampling, and
``exp(logp - old_logp)``, the importance ratio, would overflow float32 to inf."""
MAX_LOGPROB = 1e-4
"""Log-probs are <= 0; a little rounding slack."""


def check_id(value: str, what: str) -> None:
    """An id or name: non-empty and at most :data:`MAX_ID_CHARS` characters."""
    if not value:
        raise SchemaError(f"{what} is empty")
    if len(value) > MAX_ID_CHARS:
        raise SchemaError(f"{what} is {len(value)} characters, over {MAX_ID_CHARS}")
