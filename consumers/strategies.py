"""Sample strategies: which buffered groups a training step takes (``algorithm.sample_strategy``).

The experience buffer (``buffer.py``) keeps what arrived: it deduplicates, drops stale
groups, counts the arrivals of each batch, and knows the offsets a restart resumes from.
When the trainer asks it for ``n`` groups, it hands its choice to the run's strategy, a
class registered here by name (:data:`SAMPLE_STRATEGIES`, one line per strategy):

- ``default`` (:class:`BatchOrder`): batch order. The groups of the oldest batch first
  (groups without a batch, an application's, before any, in arrival order); a step waits
  while that oldest batch is incomplete (fewer than ``n`` of its groups arrived), unless
  forced (``trainer.batch_wait_s``).
- ``staleness_aware`` (:class:`FreshestFirst`): the newest model version first. The
  groups that may be taken are those the batch-order rule would not wait on: unstamped
  ones and those of complete batches (all ``n`` arrived, or a later batch trained
  already); among them, the groups of the newest version first, ties in batch order,
  then arrival. So a step does not wait on an incomplete oldest batch when ``n`` groups
  of complete later batches are buffered: it trains those, and the older groups it
  passes over stay buffered (trained later if still within ``trainer.max_staleness``,
  dropped as stale otherwise). A forced step takes the freshest ``n`` of everything
  buffered.
- ``priority_replay`` (:class:`PriorityReplay`): fresh groups first, by the batch-order
  rule; a trained group with signal (reward variance above 0) is kept in a replay pool
  and trained again, up to ``algorithm.replay_reuse_limit`` times in all. When fewer than
  ``n`` fresh groups may be taken but the batch-order rule would not wait for more (the
  oldest batch is complete: the rest of it was dropped for zero variance, for staleness,
  or trained already; or the step is forced), the step takes those fresh groups and fills
  the batch from the pool, highest priority first. A step is never made of replays alone
  (at least one fresh group drives it), so replays never advance the trainer's version
  faster than the stream of batches. Priority = reward variance x ``0.5 ** (trainer
  version - group version)`` (the version the trainer had when it last dropped stale
  groups): a group with signal, fresher first. Groups more than ``trainer.max_staleness``
  versions behind leave the pool, and so do the lowest-priority ones beyond
  ``algorithm.replay_pool_size`` (default 4 x ``trainer.batch_size``). The pool lives in
  memory and is not checkpointed: after a restart it starts empty; nothing is lost,
  since fresh groups are still committed only after the checkpoint of the step that
  trained them. A replayed group is in the ledger of every step that trains it.
- ``available`` (:class:`Available`): the ``n`` oldest groups buffered, in batch order
  like ``default``, but a step never waits for the rest of a batch: it trains what has
  arrived (the default of the ``fully_async`` sync style). Groups a slow explorer leaves
  behind are trained when they come, first, if still within ``trainer.max_staleness``.
- ``mix`` (:class:`Mix`): batch order, plus ``algorithm.expert_per_step`` expert groups
  of the trainer's expert source (``consumers/expert_data.py``: the answers of
  ``algorithm.expert_data``) as :attr:`Choice.extra`, for SFT + RL in the CHORD style; the
  step trains them with the supervised loss weighed by ``algorithm.sft_weight``.

Whatever the strategy, the buffer keeps its rules about what leaves it: a group is
gone from the buffer once taken, so a group a strategy passes over holds back its
partition's resume offset and is read again after a restart (its id is left out of the
checkpoint's dedup window); ``trained_through`` becomes the highest batch among the fresh
groups taken, so older groups still buffered wait for nothing more.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.infra.config import TrainerConfig
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ExperienceGroup

PartitionKey = tuple[str, int]


@dataclass
class Buffered:
    """A group in the buffer, with where it was read and when it arrived."""

    group: ExperienceGroup
    partition: PartitionKey
    offset: int
    seq: int
    """Arrival order."""

    @property
    def order(self) -> tuple[int, int]:
        """Batch first (unstamped, -1, before any), then arrival."""
        return (max(self.group.batch, -1), self.seq)


@dataclass(frozen=True)
class Choice:
    """What a step takes: buffered groups (they leave the buffer) and groups from
    elsewhere (a replay pool), trained after them."""

    fresh: list[Buffered]
    extra: list[ExperienceGroup] = field(default_factory=list)


Complete = Callable[[int], bool]
"""Whether nothing more of a batch is worth waiting for (``ExperienceBuffer.complete``)."""


def reward_variance(group: ExperienceGroup) -> float:
    """Population variance of the group's rewards: 0 exactly when they are all equal."""
    rewards = [e.reward for e in group.experiences]
    return statistics.pvariance(rewards) if len(rewards) > 1 else 0.0


def has_signal(group: ExperienceGroup) -> bool:
    """Whether the rewards differ: a group-relative advantage is 0 for every experience of
    a group whose rewards are all equal."""
    return len({e.reward for e in group.experiences}) > 1


@dataclass(frozen=True)
class SamplingOptions:
    """What a strategy is built from: the resolved algorithm and the trainer's config."""

    batch_size: int = TrainerConfig().batch_size
    replay_reuse_limit: int = AlgorithmSpec.replay_reuse_limit
    replay_pool_size: int = AlgorithmSpec.replay_pool_size
    """0: 4 x ``batch_size``."""
    experts: Callable[[int, int], list[ExperienceGroup]] | None = None
    """``(step, version) -> expert groups`` of the ``mix`` strategy (``ExpertSource.take``)."""

    @property
    def pool_cap(self) -> int:
        return self.replay_pool_size or 4 * self.batch_size


class SampleStrategy:
    """Chooses a step's groups among those buffered; may keep what was trained."""

    def __init__(self, options: SamplingOptions) -> None:
        self.options = options

    def choose(
        self, items: Sequence[Buffered], n: int, force: bool, complete: Complete
    ) -> Choice | None:
        """``n`` groups to train, or None to wait for more. ``force``: stop waiting for an
        incomplete batch (nothing of it arrived for ``trainer.batch_wait_s``)."""
        raise NotImplementedError

    def taken(self, choice: Choice) -> None:
        """``choice`` is being trained."""

    def drop_stale(self, version: int, max_staleness: int) -> None:
        """The trainer is at ``version``: forget what is more than ``max_staleness``
        versions behind."""

    def clear(self, step: int = 0) -> None:
        """Forget everything kept (a restore of a checkpoint taken after ``step`` steps)."""


class BatchOrder(SampleStrategy):
    """``default``: the first ``n`` in batch order, when the oldest batch among them is
    complete (or ``force``)."""

    def choose(
        self, items: Sequence[Buffered], n: int, force: bool, complete: Complete
    ) -> Choice | None:
        if len(items) < n:
            return None
        chosen = sorted(items, key=lambda item: item.order)[:n]
        oldest = min((i.group.batch for i in chosen if i.group.batch >= 0), default=None)
        if not force and oldest is not None and not complete(oldest):
            return None
        return Choice(chosen)


class FreshestFirst(SampleStrategy):
    """``staleness_aware``: of the groups the batch order would not wait on (all, when
    forced), the ``n`` of the newest versions."""

    def choose(
        self, items: Sequence[Buffered], n: int, force: bool, complete: Complete
    ) -> Choice | None:
        ready = [i for i in items if force or i.group.batch < 0 or complete(i.group.batch)]
        if len(ready) < n:
            return None
        return Choice(sorted(ready, key=lambda i: (-i.group.model_version, i.order))[:n])


class Available(SampleStrategy):
    """``available``: the first ``n`` in batch order, never waiting for a batch."""

    def choose(
        self, items: Sequence[Buffered], n: int, force: bool, complete: Complete
    ) -> Choice | None:
        if len(items) < n:
            return None
        return Choice(sorted(items, key=lambda item: item.order)[:n])


@dataclass
class Replay:
    """A trained group in the replay pool."""

    group: ExperienceGroup
    variance: float
    uses: int
    """Times trained so far."""
    seq: int
    """When it entered the pool."""


class PriorityReplay(BatchOrder):
    """``priority_replay``: fresh groups by batch order, the rest of a batch that would
    not wait from the pool of trained groups, by priority."""

    def __init__(self, options: SamplingOptions) -> None:
        super().__init__(options)
        self.pool: dict[str, Replay] = {}
        """Group id -> entry."""
        self.version = 0
        """The trainer's version at the last :meth:`drop_stale`."""
        self._seq = 0

    def priority(self, entry: Replay) -> float:
        """Reward variance, halved for each version the group is behind the trainer."""
        return entry.variance * 0.5 ** (self.version - entry.group.model_version)

    def choose(
        self, items: Sequence[Buffered], n: int, force: bool, complete: Complete
    ) -> Choice | None:
        whole = super().choose(items, n, force, complete)
        if whole is not None or not items:
            return whole
        fresh = self._fresh(sorted(items, key=lambda item: item.order), force, complete)
        replays = self._ranked()[: n - len(fresh)]
        if not fresh or len(fresh) + len(replays) < n:
            return None
        return Choice(fresh, [r.group for r in replays])

    @staticmethod
    def _fresh(ordered: list[Buffered], force: bool, complete: Complete) -> list[Buffered]:
        """All of ``ordered`` (fewer than a step) when forced; else, when the oldest batch
        is complete, the groups in order up to the first of an incomplete batch."""
        if force:
            return ordered
        oldest = min((i.group.batch for i in ordered if i.group.batch >= 0), default=None)
        if oldest is None or not complete(oldest):
            return []  # only unstamped groups wait for n, as in batch order; or the oldest
        fresh = []
        for item in ordered:
            if item.group.batch >= 0 and not complete(item.group.batch):
                break
            fresh.append(item)
        return fresh

    def _ranked(self) -> list[Replay]:
        """The pool, highest priority first (then fewer uses, then earlier)."""
        return sorted(self.pool.values(), key=lambda r: (-self.priority(r), r.uses, r.seq))

    def taken(self, choice: Choice) -> None:
        for group in choice.extra:
            entry = self.pool[group.id]
            entry.uses += 1
            if entry.uses >= self.options.replay_reuse_limit:
                del self.pool[group.id]
        if self.options.replay_reuse_limit > 1:
            for item in choice.fresh:
                variance = reward_variance(item.group)
                if variance > 0:
                    self._seq += 1
                    self.pool[item.group.id] = Replay(item.group, variance, 1, self._seq)
        for entry in self._ranked()[self.options.pool_cap :]:
            del self.pool[entry.group.id]

    def drop_stale(self, version: int, max_staleness: int) -> None:
        self.version = version
        for gid, entry in list(self.pool.items()):
            if version - entry.group.model_version > max_staleness:
                del self.pool[gid]

    def clear(self, step: int = 0) -> None:
        self.pool.clear()


class Mix(BatchOrder):
    """``mix``: the batch-order choice plus the expert source's groups of this step."""

    def __init__(self, options: SamplingOptions) -> None:
        super().__init__(options)
        if options.experts is None:
            raise ConfigError("algorithm.sample_strategy: 'mix' needs algorithm.expert_data")
        self.experts = options.experts
        self.steps = 0
        """Steps chosen so far (the expert source's position)."""
        self.version = 0

    def choose(
        self, items: Sequence[Buffered], n: int, force: bool, complete: Complete
    ) -> Choice | None:
        choice = super().choose(items, n, force, complete)
        if choice is None:
            return None
        return Choice(choice.fresh, self.experts(self.steps, self.version))

    def taken(self, choice: Choice) -> None:
        self.steps += 1

    def drop_stale(self, version: int, max_staleness: int) -> None:
        self.version = version

    def clear(self, step: int = 0) -> None:
        self.steps = step  # a resumed run goes on with the expert tasks of its next step


SAMPLE_STRATEGIES: dict[str, Callable[[SamplingOptions], SampleStrategy]] = {
    "default": BatchOrder,
    "staleness_aware": FreshestFirst,
    "available": Available,
    "priority_replay": PriorityReplay,
    "mix": Mix,
}
"""``algorithm.sample_strategy`` -> the strategy's class."""


def check_strategy(spec: AlgorithmSpec) -> None:
    """A :class:`ConfigError` naming the field for an unknown strategy, or ``mix`` without
    ``algorithm.expert_data``."""
    if spec.sample_strategy not in SAMPLE_STRATEGIES:
        raise ConfigError(
            f"algorithm.sample_strategy: unknown name {spec.sample_strategy!r}; known: "
            f"{', '.join(SAMPLE_STRATEGIES)}"
        )
    if spec.sample_strategy == "mix" and not spec.expert_data:
        raise ConfigError(
            f"algorithm.expert_data: required by sample_strategy 'mix' (algorithm.type "
            f"{spec.name!r}): a JSONL task set with answers"
        )


def make_strategy(
    spec: AlgorithmSpec,
    tcfg: TrainerConfig,
    experts: Callable[[int, int], list[ExperienceGroup]] | None = None,
) -> SampleStrategy:
    """The strategy ``spec`` names (:func:`check_strategy`). ``experts``: the expert
    source of ``mix``."""
    check_strategy(spec)
    options = SamplingOptions(
        batch_size=tcfg.batch_size,
        replay_reuse_limit=spec.replay_reuse_limit,
        replay_pool_size=spec.replay_pool_size,
        experts=experts,
    )
    return SAMPLE_STRATEGIES[spec.sample_strategy](options)
