"""What serve mode remembers between a completion and its publication: pure bookkeeping.

Every choice of every completion is a :class:`Recorded` response under its response id
(``chatcmpl-...``, choice index). Responses belong to a *group*: the request's conversation
id when it gave one, else its own response id (the ``n`` choices of one request). Feedback
sets rewards; a group is published (:meth:`Recorder.ready`, :meth:`Recorder.commit`) as one
experience group per model version among its rewarded responses (a group's experiences
share one version on the wire), and those responses are then forgotten. Responses that
never get a reward expire after ``serve.unrewarded_ttl_s``.

**Episodes** (``serve.record: episode``, :mod:`.episodes`): a response that continues an
earlier one joins its group and holds the whole episode so far (the first prompt, every
token after it, the mask 1 on the policy's own); the earlier one is then *continued*: never
published itself (its continuations carry it), a reward given to it goes to the episodes
that continue it, and it is forgotten once they all are. A GRPO group is then the episodes
of one conversation id (an agent workflow's task: its episodes).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

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


Ref = tuple[str, int]
"""A recorded response: its response id and choice index."""


def tokens_of(rollouts: list[Rollout]) -> int:
    return sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)


@dataclass(frozen=True)
class Continuation:
    """A request found to continue a recorded response (:mod:`.episodes`)."""

    parent: Ref
    glue: list[int]
    """The ids after the recorded response up to the new turn's generation prompt."""
    glue_text: str
    prompt_ids: list[int]
    """The recorded prompt and response, then ``glue``: what the new turn samples from."""


@dataclass
class Recorded:
    """One choice of one completion, as sampled."""

    rollout: Rollout
    """The choice as sampled; a later turn of an episode: the whole episode so far."""
    version: int
    """The version that sampled it; an episode's: the oldest of its turns'."""
    temperature: float
    reward: float | None = None
    text: str = ""
    """This turn's own text (cut at a stop string): what a reward function reads."""
    answer: bytes = b""
    """Of the message the API answered with (:func:`.episodes.answer`): a later request's
    assistant message must be it. Empty: not a chat request, never continued."""
    digest: bytes = b""
    """Of the request's rendered prompt (:func:`.episodes.digest`): what a continuation's
    history must render as."""
    parent: Ref | None = None
    """The response this one continues."""
    children: list[Ref] = field(default_factory=list)
    """The responses held that continue this one."""
    continued: bool = False
    """Some response continued this one: it is published only through them."""
    turns: int = 1
    """Policy turns in :attr:`rollout`."""


@dataclass
class Group:
    """The responses of one conversation (or one request), in the order they came."""

    key: str
    responses: dict[Ref, Recorded] = field(default_factory=dict)
    last_seen: float = 0.0

    def rewarded(self) -> list[tuple[Ref, Recorded]]:
        """The responses to publish: rewarded, not continued."""
        return [
            (rid, r)
            for rid, r in self.responses.items()
            if r.reward is not None and not r.continued
        ]

    def leaves(self, ref: Ref) -> list[Ref]:
        """``ref``, or the episodes that continue it (the held responses no other one
        continues)."""
        out, stack = [], [ref]
        while stack:
            at = stack.pop()
            recorded = self.responses[at]
            if recorded.continued:
                stack += [c for c in recorded.children if c in self.responses]
            else:
                out.append(at)
        return out


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
        *,
        answers: list[bytes] | None = None,
        digest: bytes = b"",
        parent: Continuation | None = None,
    ) -> None:
        """Remember the choices of completion ``response_id`` (``answers``: of the message
        the API answered each with; ``digest``: of the request's prompt). With ``parent``
        (still held), each choice is an episode: the parent's, one turn longer, in its
        group, with the parent's reward until it gets its own."""
        before = self.get(parent.parent) if parent is not None else None
        made = [
            Recorded(r, version, temperature, text=r.text, answer=a, digest=digest)
            for r, a in zip(rollouts, answers or [b""] * len(rollouts), strict=True)
        ]
        if parent is not None and before is not None:
            made = [_extend(before, parent, m) for m in made]
            conversation = self.group_of[parent.parent[0]]
        tokens = tokens_of([m.rollout for m in made])
        self.check_room(len(made), tokens)
        key = conversation or response_id
        group = self.groups.setdefault(key, Group(key))
        for i, recorded in enumerate(made):
            group.responses[(response_id, i)] = recorded
        if parent is not None and before is not None:
            before.continued = True
            before.children += [(response_id, i) for i in range(len(made))]
        group.last_seen = now
        self.group_of[response_id] = key
        self.held += len(made)
        self.held_tokens += tokens

    def get(self, ref: Ref) -> Recorded | None:
        """The response ``ref``, if held."""
        group = self.groups.get(self.group_of.get(ref[0], ""))
        return None if group is None else group.responses.get(ref)

    def group_key(self, response_id: str) -> str | None:
        """The group (conversation) ``response_id`` belongs to, if held."""
        return self.group_of.get(response_id)

    def choices_of(self, response_id: str) -> list[tuple[Ref, Recorded]]:
        """The held choices of ``response_id``, in order."""
        group = self.groups.get(self.group_of.get(response_id, ""))
        if group is None:
            return []
        return [(rid, r) for rid, r in group.responses.items() if rid[0] == response_id]

    def responses_of(self, conversation: str) -> list[tuple[Ref, Recorded]]:
        """The held responses of group ``conversation``, in the order they came."""
        group = self.groups.get(conversation)
        return list(group.responses.items()) if group else []

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
        of ``conversation``; how many responses it reached. A continued response's reward
        goes to the episodes that continue it."""
        targets = self._targets(response_id, conversation)
        if choice is not None:
            targets = [(rid, r) for rid, r in targets if rid[1] == choice]
            if not targets:
                raise UnknownResponse(f"response {response_id!r} has no choice {choice}")
        if not targets:
            return 0
        group = self.groups[self.group_of[targets[0][0][0]]]
        reached = {leaf for rid, _ in targets for leaf in group.leaves(rid)}
        for leaf in reached:
            group.responses[leaf].reward = reward
        return len(reached)

    def _targets(
        self, response_id: str | None, conversation: str | None
    ) -> list[tuple[Ref, Recorded]]:
        if (response_id is None) == (conversation is None):
            raise UnknownResponse("give exactly one of response_id and conversation_id")
        if conversation is not None:
            targets = self.responses_of(conversation)  # a group is forgotten once empty
            if not targets:
                raise UnknownResponse(
                    f"unknown (or already committed) conversation {conversation!r}"
                )
            return targets
        targets = self.choices_of(response_id or "")  # so is a response without choices
        if not targets:
            raise UnknownResponse(f"unknown (or already committed) response {response_id!r}")
        return targets

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
        stale = [rid for rid, r in group.responses.items() if r.reward is None and not r.continued]
        self.expired += len(stale)
        self._remove(group, stale)

    def _close(self, key: str, now: float) -> list[ExperienceGroup]:
        """The rewarded responses of group ``key`` as experience groups (one per version);
        the rest of the group stays."""
        group = self.groups[key]
        rewarded = group.rewarded()
        self._remove(group, [rid for rid, _ in rewarded])
        by_version: dict[int, list[Recorded]] = {}
        for _, recorded in rewarded:
            by_version.setdefault(recorded.version, []).append(recorded)
        return [
            self._group(key, v, part, now)
            for v, rs in sorted(by_version.items())
            for part in _parts(rs, self.max_group_bytes)
        ]

    def _remove(self, group: Group, refs: list[Ref]) -> None:
        """Drop ``refs`` from ``group``, and each continued response once nothing held
        continues it."""
        removed, stack = [], list(refs)
        while stack:
            recorded = group.responses.pop(ref := stack.pop(), None)
            if recorded is None:
                continue
            removed.append((ref, recorded))
            parent = group.responses.get(recorded.parent) if recorded.parent else None
            if parent is not None:
                parent.children.remove(ref)
                if not parent.children:
                    stack.append(recorded.parent)  # type: ignore[arg-type]
        self._forget(group, removed)

    def _forget(self, group: Group, removed: list[tuple[Ref, Recorded]]) -> None:
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


def _extend(before: Recorded, how: Continuation, turn: Recorded) -> Recorded:
    """``turn`` (sampled after ``before`` and the glue of ``how``) as the episode they
    make: inserted tokens with mask 0 and log-prob 0.0."""
    old, new = before.rollout, turn.rollout
    mask = [1] * len(old.response_ids) if old.mask is None else old.mask
    rollout = Rollout(
        prompt_ids=old.prompt_ids,
        response_ids=old.response_ids + how.glue + new.response_ids,
        logprobs=old.logprobs + [0.0] * len(how.glue) + new.logprobs,
        text=old.text + how.glue_text + new.text,
        truncated=new.truncated,
        mask=mask + [0] * len(how.glue) + [1] * len(new.response_ids),
    )
    return replace(
        turn,
        rollout=rollout,
        version=min(before.version, turn.version),
        reward=before.reward,
        parent=how.parent,
        turns=before.turns + 1,
    )


def _experience(eid: str, recorded: Recorded, version: int) -> Experience:
    assert recorded.reward is not None
    info = {"temperature": recorded.temperature, "turns": float(recorded.turns)}
    return recorded.rollout.experience(eid, recorded.reward, version, info)
