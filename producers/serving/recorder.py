"""What serve mode remembers between a completion and its publication: pure bookkeeping.

Every choice of every completion is a :class:`Recorded` response under its response id
(``chatcmpl-...``, choice index). Responses belong to a *group*: the request's conversation
id when it gave one, else its own response id (the ``n`` choices of one request). Feedback
sets rewards; a group is published (:meth:`Recorder.ready`, :meth:`Recorder.commit`) as one
experience group per model version among its rewarded responses (a group's experiences
share one version on the wire), and those responses are then forgotten. Responses that
never get a reward expire after ``serve.unrewarded_ttl_s``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from streamrft.producers.engines.base import Rollout
from streamrft.schemas import limits
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.experience import Experience, ExperienceGroup, make_group_id

SERVE_WORKFLOW = "serve"
"""The ``workflow`` of groups serve mode publishes."""


class UnknownResponse(StreamRFTError):
    """A feedback or commit named a response or conversation this server does not hold."""


class Full(StreamRFTError):
    """``serve.max_recorded`` responses (or ``serve.max_recorded_tokens`` tokens) are held
    already."""


def tokens_of(rollouts: list[Rollout]) -> int:
    return sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)


@dataclass
class Recorded:
    """One choice of one completion, as sampled."""

    rollout: Rollout
    version: int
    temperature: float
    reward: float | None = None


@dataclass
class Group:
    """The responses of one conversation (or one request), in the order they came."""

    key: str
    responses: dict[tuple[str, int], Recorded] = field(default_factory=dict)
    last_seen: float = 0.0

    def rewarded(self) -> list[tuple[tuple[str, int], Recorded]]:
        return [(rid, r) for rid, r in self.responses.items() if r.reward is not None]


class Recorder:
    """Responses waiting for feedback and publication, for one serve process ``server``."""

    def __init__(
        self,
        run: str,
        server: str,
        group_size: int,
        max_recorded: int,
        max_group_bytes: int = 8 << 20,
        max_tokens: int = 0,
    ) -> None:
        self.run = run
        self.server = server
        self.group_size = group_size
        self.max_recorded = max_recorded
        self.max_tokens = max_tokens
        """Tokens (prompt + response) held at most (0: no bound): what bounds the memory."""
        self.held_tokens = 0
        self.max_group_bytes = max_group_bytes
        """A published group is split to stay under this (about half the broker's record
        limit) and under ``MAX_EXPERIENCES_PER_GROUP`` experiences."""
        self.groups: dict[str, Group] = {}
        self.group_of: dict[str, str] = {}
        """Response id -> group key."""
        self.held = 0
        self.expired = 0
        self._seq = itertools.count()

    def record(
        self,
        response_id: str,
        rollouts: list[Rollout],
        version: int,
        temperature: float,
        conversation: str | None,
        now: float,
    ) -> None:
        """Remember the choices of completion ``response_id``."""
        tokens = tokens_of(rollouts)
        self.check_room(len(rollouts), tokens)
        key = conversation or response_id
        group = self.groups.setdefault(key, Group(key))
        for i, rollout in enumerate(rollouts):
            group.responses[(response_id, i)] = Recorded(rollout, version, temperature)
        group.last_seen = now
        self.group_of[response_id] = key
        self.held += len(rollouts)
        self.held_tokens += tokens

    def check_room(self, responses: int, tokens: int) -> None:
        """Raise :class:`Full` unless ``responses`` more of ``tokens`` in all fit: asked
        before a request is sampled (with its largest size), and again when it is
        recorded."""
        if self.held + responses > self.max_recorded:
            raise Full(
                f"{self.held} responses wait for feedback or commit (serve.max_recorded="
                f"{self.max_recorded}); commit or give feedback first"
            )
        if self.max_tokens and self.held_tokens + tokens > self.max_tokens:
            raise Full(
                f"{self.held_tokens} tokens of responses wait for feedback or commit "
                f"(serve.max_recorded_tokens={self.max_tokens}); commit or give feedback first"
            )

    def feedback(
        self,
        reward: float,
        response_id: str | None = None,
        conversation: str | None = None,
        choice: int | None = None,
    ) -> int:
        """Set ``reward`` on a response's choices (or one ``choice``), or on every response
        of ``conversation``; how many responses it reached."""
        targets = self._targets(response_id, conversation)
        if choice is not None:
            targets = [(rid, r) for rid, r in targets if rid[1] == choice]
            if not targets:
                raise UnknownResponse(f"response {response_id!r} has no choice {choice}")
        for _, recorded in targets:
            recorded.reward = reward
        return len(targets)

    def _targets(
        self, response_id: str | None, conversation: str | None
    ) -> list[tuple[tuple[str, int], Recorded]]:
        if (response_id is None) == (conversation is None):
            raise UnknownResponse("give exactly one of response_id and conversation_id")
        if conversation is not None:
            group = self.groups.get(conversation)
            if group is None:
                raise UnknownResponse(
                    f"unknown (or already committed) conversation {conversation!r}"
                )
            return list(group.responses.items())
        key = self.group_of.get(response_id or "")
        if key is None:
            raise UnknownResponse(f"unknown (or already committed) response {response_id!r}")
        return [(rid, r) for rid, r in self.groups[key].responses.items() if rid[0] == response_id]

    def commit(
        self, now: float, response_id: str | None = None, conversation: str | None = None
    ) -> list[ExperienceGroup]:
        """Publishable groups of the rewarded responses: of the group holding
        ``response_id``, of ``conversation``, or of every group (neither given)."""
        if response_id is None and conversation is None:
            keys = list(self.groups)
        elif conversation is not None:
            if conversation not in self.groups:
                raise UnknownResponse(
                    f"unknown (or already committed) conversation {conversation!r}"
                )
            keys = [conversation]
        else:
            if response_id not in self.group_of:
                raise UnknownResponse(f"unknown (or already committed) response {response_id!r}")
            keys = [self.group_of[response_id]]
        return [g for key in keys for g in self._close(key, now)]

    def ready(self, now: float, timeout_s: float, ttl_s: float) -> list[ExperienceGroup]:
        """Groups due by ``serve.group_size`` or ``group_timeout_s``; drops responses that
        waited for a reward longer than ``ttl_s``."""
        out: list[ExperienceGroup] = []
        for key, group in list(self.groups.items()):
            self._expire(group, now, ttl_s)
            rewarded = len(group.rewarded())
            full = self.group_size and rewarded >= self.group_size
            idle = timeout_s and rewarded and now - group.last_seen >= timeout_s
            if full or idle:
                out += self._close(key, now)
        return out

    def _expire(self, group: Group, now: float, ttl_s: float) -> None:
        if now - group.last_seen < ttl_s:
            return
        stale = [(rid, r) for rid, r in group.responses.items() if r.reward is None]
        for rid, _ in stale:
            del group.responses[rid]
        self.expired += len(stale)
        self._forget(group, stale)

    def _close(self, key: str, now: float) -> list[ExperienceGroup]:
        """The rewarded responses of group ``key`` as experience groups (one per version);
        the rest of the group stays."""
        group = self.groups[key]
        rewarded = group.rewarded()
        for rid, _ in rewarded:
            del group.responses[rid]
        self._forget(group, rewarded)
        by_version: dict[int, list[Recorded]] = {}
        for _, recorded in rewarded:
            by_version.setdefault(recorded.version, []).append(recorded)
        return [
            self._group(key, v, part, now)
            for v, rs in sorted(by_version.items())
            for part in _parts(rs, self.max_group_bytes)
        ]

    def _forget(self, group: Group, removed: list[tuple[tuple[str, int], Recorded]]) -> None:
        """Book ``removed`` responses of ``group`` gone; forget what is left empty."""
        self.held -= len(removed)
        self.held_tokens -= tokens_of([r.rollout for _, r in removed])
        alive = {rid[0] for rid in group.responses}
        for response_id in {rid[0] for rid, _ in removed} - alive:
            self.group_of.pop(response_id, None)
        if not group.responses:
            del self.groups[group.key]

    def _group(
        self, key: str, version: int, responses: list[Recorded], now: float
    ) -> ExperienceGroup:
        """Task id ``serve:<server>:<n>:<group key>``: unique per server and publication,
        so a conversation committed twice is two groups, never deduplicated into one."""
        task_id = f"serve:{self.server}:{next(self._seq)}:{key}"
        gid = make_group_id(self.run, task_id, 0)
        return ExperienceGroup(
            id=gid,
            run=self.run,
            task_id=task_id,
            explorer=self.server,
            model_version=version,
            experiences=[_experience(f"{gid}#{i}", r, version) for i, r in enumerate(responses)],
            created_at=now,
            workflow=SERVE_WORKFLOW,
        )


def _size(recorded: Recorded) -> int:
    """About how many bytes ``recorded`` takes in a published group."""
    r = recorded.rollout
    return 4 * len(r.prompt_ids) + 9 * len(r.response_ids) + 4 * len(r.text) + 256


def _parts(responses: list[Recorded], max_bytes: int) -> list[list[Recorded]]:
    """``responses`` in order, cut into groups of at most ``MAX_EXPERIENCES_PER_GROUP``
    and about ``max_bytes`` each."""
    parts: list[list[Recorded]] = [[]]
    size = 0
    for recorded in responses:
        grows = _size(recorded)
        full = len(parts[-1]) >= limits.MAX_EXPERIENCES_PER_GROUP or size + grows > max_bytes
        if parts[-1] and full:
            parts.append([])
            size = 0
        parts[-1].append(recorded)
        size += grows
    return parts


def _experience(eid: str, recorded: Recorded, version: int) -> Experience:
    assert recorded.reward is not None
    info = {"temperature": recorded.temperature}
    return recorded.rollout.experience(eid, recorded.reward, version, info)
