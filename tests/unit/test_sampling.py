"""Sample strategies and DAPO dynamic sampling in the trainer's experience buffer."""

from __future__ import annotations

import itertools

import pytest

from streamrft.consumers.algorithms.presets import algorithm_spec
from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.intake import StreamActivity
from streamrft.consumers.state import STATE_DECODER, STATE_ENCODER
from streamrft.consumers.strategies import (
    SAMPLE_STRATEGIES,
    Available,
    FreshestFirst,
    PriorityReplay,
    SamplingOptions,
    make_strategy,
    reward_variance,
)
from streamrft.infra.config import AlgorithmConfig, TrainerConfig, from_dict
from streamrft.schemas import ExperienceGroup
from streamrft.schemas.errors import ConfigError
from tests.helpers.configs import cfg_of
from tests.helpers.groups import make_group

pytestmark = pytest.mark.unit

P0 = ("run.experiences", 0)
P1 = ("run.experiences", 1)
SIGNAL = [0.0, 1.0]
"""Rewards of a group with signal (variance 0.25)."""
FLAT = [1.0, 1.0]
"""Rewards all equal: no signal."""


def group(
    gid: str, version: int = 0, batch: int = -1, rewards: list[float] | None = None
) -> ExperienceGroup:
    return make_group("run", gid, version, 2, rewards=rewards or SIGNAL, group_id=gid, batch=batch)


def ids(groups: list[ExperienceGroup] | None) -> list[str] | None:
    return None if groups is None else [g.id for g in groups]


def restored(buf: ExperienceBuffer, **kwargs) -> ExperienceBuffer:
    """A new buffer restored from ``buf``'s checkpoint state, through its JSON encoding."""
    state = buf.state(step=3, version=2, counters={})
    resumed = ExperienceBuffer(buf.max_staleness, buf.dedup_window, **kwargs)
    resumed.restore(STATE_DECODER.decode(STATE_ENCODER.encode(state)))
    return resumed


# -- the registry ------------------------------------------------------------------------------


def test_strategies_are_named_in_config_and_an_unknown_name_says_which_field():
    tcfg = TrainerConfig(batch_size=4)
    spec = algorithm_spec(AlgorithmConfig(), 8)
    assert (spec.sample_strategy, spec.dynamic_sampling) == ("default", False)
    assert type(make_strategy(spec, tcfg)) is SAMPLE_STRATEGIES["default"]
    dapo = algorithm_spec(AlgorithmConfig(type="dapo"), 8)
    assert dapo.dynamic_sampling is True
    assert (
        algorithm_spec(AlgorithmConfig(type="dapo", dynamic_sampling=False), 8).dynamic_sampling
        is False
    )
    replay = algorithm_spec(
        AlgorithmConfig(sample_strategy="priority_replay", replay_reuse_limit=3), 8
    )
    strategy = make_strategy(replay, tcfg)
    assert isinstance(strategy, PriorityReplay)
    assert strategy.options.replay_reuse_limit == 3
    assert strategy.options.pool_cap == 16  # 4 x trainer.batch_size by default
    assert isinstance(
        make_strategy(algorithm_spec(AlgorithmConfig(sample_strategy="staleness_aware"), 8), tcfg),
        FreshestFirst,
    )
    bad = algorithm_spec(AlgorithmConfig(sample_strategy="newest"), 8)
    with pytest.raises(ConfigError, match=r"algorithm\.sample_strategy: unknown name 'newest'"):
        make_strategy(bad, tcfg)


def test_the_trainer_refuses_an_unknown_strategy_before_it_loads_a_model():
    from streamrft.consumers.trainer import Trainer

    cfg = from_dict(cfg_of(run={"id": "r1"}, algorithm={"sample_strategy": "nope"}))
    with pytest.raises(ConfigError, match=r"^algorithm\.sample_strategy: unknown name 'nope'"):
        Trainer(cfg, evaluate=None)


def test_reward_variance():
    assert reward_variance(group("a", rewards=[1.0, 1.0, 1.0])) == 0.0
    assert reward_variance(group("b", rewards=[0.0, 1.0])) == 0.25
    assert reward_variance(group("c", rewards=[0.3, 0.3, 0.3])) == 0.0  # exactly


# -- dynamic sampling ----------------------------------------------------------------------


def test_dynamic_sampling_drops_flat_groups_and_fills_the_batch_from_the_next():
    buf = ExperienceBuffer(max_staleness=1, dynamic_sampling=True)
    for offset, (gid, rewards) in enumerate(
        [("a", SIGNAL), ("b", FLAT), ("c", FLAT), ("d", SIGNAL)]
    ):
        assert buf.offer(group(gid, batch=0, rewards=rewards), P0, offset) is True
    assert buf.zero_variance_dropped == 2 and len(buf) == 2
    assert buf.arrived == {0: 4}  # the dropped ones arrived: batch 0 is complete
    assert buf.take(4) is None  # not a short batch: it waits for more
    buf.offer(group("e", batch=1, rewards=FLAT), P1, 0)
    buf.offer(group("f", batch=1), P1, 1)
    assert buf.take(4) is None  # 3 with signal
    buf.offer(group("g", batch=1), P1, 2)
    assert ids(buf.take(4)) == ["a", "d", "f", "g"]  # batch 0's rest, filled from batch 1
    assert buf.trained_through == 1


def test_a_batch_all_dropped_is_waited_for_by_nobody():
    buf = ExperienceBuffer(max_staleness=1, dynamic_sampling=True)
    for offset in range(2):
        buf.offer(group(f"flat{offset}", batch=0, rewards=FLAT), P0, offset)
    buf.offer(group("x", batch=1), P0, 2)
    assert buf.waiting_for() == 1  # nothing of batch 0 is left to wait on
    buf.offer(group("y", batch=1), P0, 3)
    assert ids(buf.take(2)) == ["x", "y"]


def test_without_dynamic_sampling_a_flat_group_is_trained():
    buf = ExperienceBuffer(max_staleness=1)
    buf.offer(group("flat", rewards=FLAT), P0, 0)
    assert ids(buf.take(1)) == ["flat"] and buf.zero_variance_dropped == 0


def test_dropped_groups_are_done_for_resume_offsets_and_remembered_as_seen():
    buf = ExperienceBuffer(max_staleness=1, dynamic_sampling=True)
    buf.offer(group("flat0", rewards=FLAT), P0, 10)
    assert buf.resume_offsets() == {P0: 11}  # nothing to read again
    buf.offer(group("keep"), P0, 11)
    buf.offer(group("flat1", rewards=FLAT), P0, 12)
    assert buf.resume_offsets() == {P0: 11}  # "keep" is still buffered
    assert buf.offer(group("flat0", rewards=FLAT), P1, 0) is False  # a copy: a duplicate
    assert (buf.duplicates_dropped, buf.zero_variance_dropped) == (1, 2)
    assert ids(buf.take(1)) == ["keep"]
    assert buf.resume_offsets() == {P0: 13, P1: 1}
    resumed = restored(buf, dynamic_sampling=True)
    assert resumed.zero_variance_dropped == 2  # in the checkpoint, like stale_dropped
    assert resumed.resume_offsets() == {P0: 13, P1: 1}
    # copies of dropped groups published later are still recognised after the restart
    assert resumed.offer(group("flat1", rewards=FLAT), P1, 1) is False
    assert resumed.zero_variance_dropped == 2


# -- staleness_aware -----------------------------------------------------------------------


def freshest(max_staleness: int = 5) -> ExperienceBuffer:
    return ExperienceBuffer(max_staleness, strategy=FreshestFirst(SamplingOptions(batch_size=2)))


def test_staleness_aware_takes_the_newest_versions_first_ties_in_batch_order():
    buf = freshest()
    arrivals = [("o1", 1, 0), ("o2", 1, 0), ("n1", 3, 1), ("m1", 2, 1), ("n2", 3, 2), ("n3", 3, 2)]
    for offset, (gid, version, batch) in enumerate(arrivals):
        buf.offer(group(gid, version, batch), P0, offset)
    assert ids(buf.take(2)) == ["n1", "n2"]  # version 3; batch 1 before batch 2
    assert ids(buf.take(2)) == ["n3", "m1"]
    assert ids(buf.take(2)) == ["o1", "o2"]


def test_staleness_aware_does_not_wait_on_an_incomplete_oldest_batch():
    buf = freshest()
    buf.offer(group("old", 0, batch=0), P0, 0)  # batch 0: 1 of 2, the other still exploring
    buf.offer(group("b1", 1, batch=1), P0, 1)
    assert buf.take(2) is None  # batch 1 is incomplete too: nothing may be taken yet
    buf.offer(group("b2", 1, batch=1), P1, 0)
    assert ids(buf.take(2)) == ["b1", "b2"]  # batch 1 complete: batch 0 is not waited on
    assert buf.trained_through == 1
    # the group passed over is untrained: a restart reads it again
    assert buf.resume_offsets() == {P0: 0, P1: 1}
    resumed = restored(buf, strategy=FreshestFirst(SamplingOptions(batch_size=2)))
    assert resumed.offer(group("old", 0, batch=0), P0, 0) is True  # not a duplicate
    assert resumed.offer(group("b1", 1, batch=1), P0, 1) is False  # trained: a duplicate
    resumed.offer(group("new", 2, batch=2), P0, 2)
    resumed.offer(group("new2", 2, batch=2), P0, 3)
    # batch 0 is older than a batch trained: it waits for nothing, but is the stalest
    assert ids(resumed.take(2)) == ["new", "new2"]
    assert ids(resumed.take(1)) == ["old"]
    assert resumed.resume_offsets() == {P0: 4, P1: 1}


def test_available_takes_the_oldest_groups_buffered_and_never_waits_for_a_batch():
    buf = ExperienceBuffer(1, strategy=Available(SamplingOptions(batch_size=2)))
    buf.offer(group("b1", 1, batch=1), P0, 0)  # a fast explorer's later batch first
    buf.offer(group("b0", 0, batch=0), P1, 0)  # batch 0: 1 of 2, the other still exploring
    assert ids(buf.take(2)) == ["b0", "b1"]  # batch order, neither batch complete
    buf.offer(group("b2", 1, batch=1), P0, 1)
    assert buf.take(2) is None  # only the count is waited for
    buf.offer(group("late", 0, batch=0), P1, 1)
    assert ids(buf.take(2)) == ["late", "b2"]  # the straggler first
    assert buf.resume_offsets() == {P0: 2, P1: 2}
    buf.offer(group("s", 0, batch=0), P0, 2)
    assert ids(buf.drop_stale(2)) == ["s"]  # still bounded by max_staleness


def test_fully_async_waits_for_no_batch_unless_a_strategy_is_named():
    from streamrft.consumers.algorithms.presets import resolve_algorithm

    fully = {"synchronizer": {"style": "fully_async"}}
    assert resolve_algorithm(from_dict(cfg_of(**fully))).spec.sample_strategy == "available"
    named = cfg_of(**fully, algorithm={"sample_strategy": "default"})
    assert resolve_algorithm(from_dict(named)).spec.sample_strategy == "default"
    chord = cfg_of(**fully, algorithm={"type": "chord", "expert_data": "x.jsonl"})
    assert resolve_algorithm(from_dict(chord)).spec.sample_strategy == "mix"  # the preset's
    assert resolve_algorithm(from_dict(cfg_of())).spec.sample_strategy == "default"


def test_staleness_aware_still_drops_stale_and_a_forced_step_takes_the_freshest_of_all():
    buf = freshest(max_staleness=1)
    buf.offer(group("v0", 0, batch=0), P0, 0)
    buf.offer(group("v2", 2, batch=1), P0, 1)
    buf.offer(group("v1", 1, batch=0), P0, 2)
    assert ids(buf.drop_stale(2)) == ["v0"]
    assert buf.take(2) is None  # batches 0 (2 of 2 arrived) fine, batch 1 has 1 of 2
    assert ids(buf.take(2, force=True)) == ["v2", "v1"]


# -- priority_replay -----------------------------------------------------------------------


def replaying(limit: int = 2, pool: int = 0, dynamic: bool = True) -> ExperienceBuffer:
    options = SamplingOptions(batch_size=2, replay_reuse_limit=limit, replay_pool_size=pool)
    return ExperienceBuffer(1, strategy=PriorityReplay(options), dynamic_sampling=dynamic)


OFFSETS = itertools.count()


def fill(buf: ExperienceBuffer, batch: int, groups: list[tuple[str, list[float]]], version=0):
    """Offer ``(group id, rewards)`` of ``batch`` at ``version``, at the next offsets."""
    for gid, rewards in groups:
        buf.offer(group(gid, version, batch, rewards), P0, next(OFFSETS))


def test_priority_replay_takes_fresh_batches_whole_and_replays_only_to_fill_one():
    buf = replaying()
    fill(buf, 0, [("a", [0.0, 1.0]), ("b", [0.0, 0.5])])  # variances 0.25, 0.0625
    assert ids(buf.take(2)) == ["a", "b"] and buf.last_replayed == 0
    fill(buf, 1, [("c", [0.0, 1.0]), ("d", FLAT)])  # d dropped: batch 1 complete with 1
    assert ids(buf.take(2)) == ["c", "a"]  # the rest from the pool, highest priority
    assert buf.last_replayed == 1
    assert buf.trained_through == 1
    # "a" was trained twice (the limit): it left the pool; "b" and "c" are in it
    assert sorted(buf.strategy.pool) == ["b", "c"]


def test_priority_replay_never_trains_replays_alone_nor_skips_a_waiting_batch():
    buf = replaying()
    fill(buf, 0, [("a", SIGNAL), ("b", SIGNAL)])
    buf.take(2)
    assert buf.take(2) is None  # nothing fresh: no step of replays alone
    fill(buf, 1, [("c", SIGNAL)])  # batch 1 has 1 of 2: its other group is exploring
    assert buf.take(2) is None
    assert ids(buf.take(2, force=True)) == ["c", "a"]  # forced: filled from the pool


def test_priority_is_variance_halved_per_version_behind():
    options = SamplingOptions(batch_size=3, replay_reuse_limit=3)
    buf = ExperienceBuffer(5, strategy=PriorityReplay(options), dynamic_sampling=True)
    buf.offer(group("old-wide", 0, 0, [0.0, 1.0]), P0, 0)  # 0.25 x 0.5**(2-0) = 0.0625
    buf.offer(group("new-narrow", 2, 0, [0.0, 0.6]), P0, 1)  # 0.09 x 0.5**0 = 0.09
    buf.offer(group("mid", 1, 0, [0.0, 0.8]), P0, 2)  # 0.16 x 0.5**1 = 0.08
    assert buf.take(3) is not None
    buf.drop_stale(2)  # the trainer is at version 2
    ranked = [r.group.id for r in buf.strategy._ranked()]
    assert ranked == ["new-narrow", "mid", "old-wide"]  # by variance alone: the reverse
    buf.offer(group("fresh", 2, 1, SIGNAL), P0, 3)
    buf.offer(group("flat", 2, 1, FLAT), P0, 4)
    buf.offer(group("flat2", 2, 1, FLAT), P0, 5)  # batch 1 complete (3 of 3), 1 kept
    assert ids(buf.take(3)) == ["fresh", "new-narrow", "mid"]
    assert buf.last_replayed == 2
    assert buf.resume_offsets() == {P0: 6}  # replays hold no offsets


def test_staleness_evicts_from_the_pool():
    buf = replaying()  # max_staleness 1
    fill(buf, 0, [("a", SIGNAL), ("b", SIGNAL)], version=0)
    buf.take(2)
    buf.drop_stale(1)
    assert sorted(buf.strategy.pool) == ["a", "b"]  # 1 behind: within max_staleness
    buf.drop_stale(2)
    assert buf.strategy.pool == {}
    assert buf.stale_dropped == 0  # trained already: not counted as stale drops


def test_reuse_limit_one_never_replays_and_flat_groups_never_enter_the_pool():
    buf = replaying(limit=1)
    fill(buf, 0, [("a", SIGNAL), ("b", SIGNAL)])
    buf.take(2)
    assert buf.strategy.pool == {}
    buf = replaying(dynamic=False)
    fill(buf, 0, [("a", FLAT), ("b", SIGNAL)])
    buf.take(2)
    assert list(buf.strategy.pool) == ["b"]


def test_the_pool_keeps_the_highest_priorities_up_to_its_cap():
    buf = replaying(limit=5, pool=3)
    rewards = {"p1": [0.0, 0.2], "p4": [0.0, 0.8], "p2": [0.0, 0.4], "p3": [0.0, 0.6]}
    for batch, pair in enumerate([("p1", "p4"), ("p2", "p3")]):
        fill(buf, batch, [(gid, rewards[gid]) for gid in pair])
        buf.take(2)
    assert sorted(buf.strategy.pool) == ["p2", "p3", "p4"]  # p1, the lowest, left


def test_the_pool_starts_empty_after_a_restore_and_no_fresh_group_is_lost():
    buf = replaying()
    fill(buf, 0, [("a", SIGNAL), ("b", SIGNAL)])
    buf.take(2)
    fill(buf, 1, [("c", SIGNAL)])  # buffered, not trained when the checkpoint is taken
    assert sorted(buf.strategy.pool) == ["a", "b"]
    state = buf.state(step=1, version=1, counters={})
    buf.restore(STATE_DECODER.decode(STATE_ENCODER.encode(state)))
    assert buf.strategy.pool == {}  # not checkpointed
    assert buf.resume_offsets() == state.resume_offsets()
    assert buf.offer(group("c", 0, 1), P0, state.offsets[0].offset) is True  # read again


# -- the intake's idle clock ---------------------------------------------------------------


def test_a_stream_of_nothing_but_flat_groups_is_idle_but_not_starved():
    activity = StreamActivity(last_record=0.0, last_signal=0.0)
    for t in range(1, 6):
        activity.saw(records=3, zero_variance=3, now=float(t))
    assert activity.last_record == 5.0  # explorers are working: not starved
    assert activity.dropped_since_signal == 15
    assert not activity.idle(4.0, timeout_s=4.0) and activity.idle(5.0, timeout_s=4.0)
    activity.saw(records=3, zero_variance=2, now=6.0)  # one group with signal
    assert not activity.idle(6.0, timeout_s=4.0) and activity.dropped_since_signal == 0
    activity.saw(records=0, zero_variance=0, now=11.0)
    assert activity.idle(11.0, timeout_s=4.0) and activity.dropped_since_signal == 0
