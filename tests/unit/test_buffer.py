"""The trainer's experience buffer: dedup, staleness, batching and resume offsets."""

from __future__ import annotations

import pytest

from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.state import (
    DIGEST_SIZE,
    STATE_DECODER,
    STATE_ENCODER,
    id_digest,
)
from streamrft.infra.config import TrainerConfig
from streamrft.schemas import ExperienceGroup
from tests.helpers.groups import make_group

pytestmark = pytest.mark.unit

P0 = ("run.experiences", 0)
P1 = ("run.experiences", 1)


def group(
    gid: str, version: int = 0, n: int = 2, exp_ids: list[str] | None = None, batch: int = -1
) -> ExperienceGroup:
    """A group whose id is ``gid`` (experience ids ``<gid>#<i>``): the buffer reads ids,
    versions and batch indices only."""
    return make_group("run", gid, version, n, group_id=gid, exp_ids=exp_ids, batch=batch)


def test_batches_go_in_order_and_wait_for_their_stragglers():
    """Two explorers share batches of 4: the fast one's half of batch 1 arrives before
    the slow one's half of batch 0; the step waits for batch 0 whole, then batch 1."""
    buf = ExperienceBuffer(max_staleness=1)
    arrivals = [("a0", 0), ("a1", 0), ("a2", 1), ("a3", 1), ("b0", 0)]
    for offset, (gid, batch) in enumerate(arrivals):
        buf.offer(group(gid, batch=batch), P0, offset)
    assert len(buf) == 5 and buf.waiting_for() == 0
    assert buf.take(4) is None  # 3 of batch 0 arrived: one is still being explored
    buf.offer(group("b1", batch=0), P1, 0)
    assert [g.id for g in buf.take(4)] == ["a0", "a1", "b0", "b1"]
    assert buf.waiting_for() == 1 and buf.take(4) is None
    for offset, gid in enumerate(["b2", "b3"], start=1):
        buf.offer(group(gid, batch=1), P1, offset)
    assert [g.id for g in buf.take(4)] == ["a2", "a3", "b2", "b3"]


def test_a_forced_take_trains_the_oldest_groups_of_an_incomplete_batch():
    buf = ExperienceBuffer(max_staleness=1)
    for offset, (gid, batch) in enumerate([("x", 2), ("a", 0), ("y", 2), ("b", 1), ("z", 2)]):
        buf.offer(group(gid, batch=batch), P0, offset)
    assert buf.take(3) is None  # batch 0 has 1 of 3
    assert [g.id for g in buf.take(3, force=True)] == ["a", "b", "x"]
    # duplicates and stale drops: a duplicate does not count as an arrival
    buf.offer(group("a", batch=0), P0, 9)
    assert buf.arrived == {0: 1, 1: 1, 2: 3}
    assert buf.trained_through == 2
    assert [g.id for g in buf.take(2)] == ["y", "z"]  # batch 2 complete (3 of 2 needed)


def test_the_rest_of_a_batch_trained_in_part_waits_for_nothing_also_after_a_restore():
    buf = ExperienceBuffer(max_staleness=1)
    for offset, (gid, batch) in enumerate([("a", 0), ("b", 1), ("c", 1)]):
        buf.offer(group(gid, batch=batch), P0, offset)
    assert [g.id for g in buf.take(2, force=True)] == ["a", "b"]  # batch 0 had 1 of 2
    buf.offer(group("a2", batch=0), P1, 0)  # the rest of batch 0, late
    state = buf.state(step=1, version=1, counters={})
    assert state.trained_through == 1
    resumed = ExperienceBuffer(max_staleness=1)
    resumed.restore(STATE_DECODER.decode(STATE_ENCODER.encode(state)))
    assert resumed.trained_through == 1
    for gid, batch, offset in [("c", 1, 2), ("a2", 0, 0)]:  # read again from the offsets
        resumed.offer(group(gid, batch=batch), P1 if gid == "a2" else P0, offset)
    # batch 0 (1 group arrived since the restore) is older than batch 1, trained in part
    assert [g.id for g in resumed.take(2)] == ["a2", "c"]


def test_groups_without_a_batch_go_first_and_wait_for_nothing():
    buf = ExperienceBuffer(max_staleness=1)
    buf.offer(group("s0", batch=0), P0, 0)
    buf.offer(group("app1"), P0, 1)
    buf.offer(group("app2"), P0, 2)
    assert [g.id for g in buf.take(2)] == ["app1", "app2"]  # batch 0 is incomplete
    buf.offer(group("app3"), P0, 3)
    assert buf.take(2) is None  # app3 and s0: batch 0 still has 1 of 2
    buf.offer(group("s1", batch=0), P1, 0)
    assert [g.id for g in buf.take(2)] == ["app3", "s0"]


def test_offer_and_dedup_by_experience_id():
    buf = ExperienceBuffer(max_staleness=1)
    assert buf.offer(group("g1"), P0, 0) is True
    assert buf.offer(group("g2"), P0, 1) is True
    # the same group delivered again (at-least-once)
    assert buf.offer(group("g1"), P0, 2) is False
    # a different group id that repeats one experience id is a duplicate too
    assert buf.offer(group("g3", exp_ids=["g3#0", "g2#1"]), P1, 0) is False
    assert buf.duplicates_dropped == 2
    assert len(buf) == 2
    assert [g.id for g in buf.take(2)] == ["g1", "g2"]
    # already trained groups are still remembered
    assert buf.offer(group("g1"), P0, 3) is False
    assert buf.duplicates_dropped == 3
    assert len(buf) == 0


def test_drop_stale():
    buf = ExperienceBuffer(max_staleness=1)
    for offset, version in enumerate([0, 1, 2, 0, 2]):
        buf.offer(group(f"g{offset}", version=version), P0, offset)
    # at version 2, staleness 2 - 0 = 2 > 1 drops the version-0 groups; 2 - 1 = 1 is kept
    dropped = buf.drop_stale(2)
    assert [g.id for g in dropped] == ["g0", "g3"]
    assert buf.stale_dropped == 2
    assert len(buf) == 3
    assert buf.drop_stale(2) == []
    dropped = buf.drop_stale(3)
    assert [g.id for g in dropped] == ["g1"]
    assert buf.stale_dropped == 3
    assert [g.id for g in buf.take(2)] == ["g2", "g4"]  # order kept


def test_drop_stale_with_zero_staleness_keeps_only_current():
    buf = ExperienceBuffer(max_staleness=0)
    buf.offer(group("old", version=4), P0, 0)
    buf.offer(group("new", version=5), P0, 1)
    assert [g.id for g in buf.drop_stale(5)] == ["old"]
    assert [g.id for g in buf.take(1)] == ["new"]


def test_take_waits_for_n_groups():
    buf = ExperienceBuffer(max_staleness=1)
    assert buf.take(1) is None
    buf.offer(group("a"), P0, 0)
    buf.offer(group("b"), P1, 0)
    assert buf.take(3) is None
    assert len(buf) == 2  # nothing consumed by a failed take
    buf.offer(group("c"), P0, 1)
    assert [g.id for g in buf.take(3)] == ["a", "b", "c"]
    assert len(buf) == 0
    assert buf.take(1) is None


def test_resume_offsets():
    buf = ExperienceBuffer(max_staleness=10)
    assert buf.resume_offsets() == {}
    buf.offer(group("a"), P0, 10)
    buf.offer(group("b"), P0, 11)
    buf.offer(group("c"), P1, 3)
    buf.offer(group("d"), P0, 12)
    # lowest buffered offset per partition
    assert buf.resume_offsets() == {P0: 10, P1: 3}
    buf.take(2)  # a (P0@10) and b (P0@11) are trained
    assert buf.resume_offsets() == {P0: 12, P1: 3}
    buf.take(2)  # c and d
    # nothing buffered: resume after the last consumed offset
    assert buf.resume_offsets() == {P0: 13, P1: 4}


def test_resume_offsets_count_duplicates_and_stale_as_consumed():
    buf = ExperienceBuffer(max_staleness=0)
    buf.offer(group("a", version=1), P0, 5)
    buf.offer(group("a", version=1), P0, 6)  # duplicate, not buffered
    buf.offer(group("old", version=0), P1, 7)
    assert buf.resume_offsets() == {P0: 5, P1: 7}
    buf.drop_stale(1)
    assert buf.resume_offsets() == {P0: 5, P1: 8}
    buf.take(1)
    assert buf.resume_offsets() == {P0: 7, P1: 8}


def test_resume_offsets_with_out_of_order_offsets():
    buf = ExperienceBuffer(max_staleness=1)
    buf.offer(group("late"), P0, 20)
    buf.offer(group("early"), P0, 15)
    assert buf.resume_offsets() == {P0: 15}
    buf.take(1)  # "late" (offset 20) goes first; "early" (15) is still buffered
    assert buf.resume_offsets() == {P0: 15}
    buf.take(1)
    assert buf.resume_offsets() == {P0: 21}


# -- the dedup window ------------------------------------------------------------------------


def test_duplicates_inside_the_window_are_caught_older_ones_are_not():
    buf = ExperienceBuffer(max_staleness=1, dedup_window=6)  # 3 groups of 2 ids
    for offset in range(5):
        assert buf.offer(group(f"g{offset}"), P0, offset)
    assert len(buf.seen) == 6
    # copies of the last three groups (any partition, any group id) are duplicates
    assert buf.offer(group("g4"), P0, 5) is False
    assert buf.offer(group("again", exp_ids=["new#0", "g2#1"]), P1, 0) is False
    assert buf.duplicates_dropped == 2
    # g1 left the window: a copy this late is taken (and trained) again, as documented
    assert buf.offer(group("g1"), P0, 6) is True
    assert len(buf.seen) == 6


def _restored(buf: ExperienceBuffer, window: int) -> ExperienceBuffer:
    """Through the checkpoint's encoding: msgspec JSON bytes and back."""
    state = buf.state(step=7, version=6, counters={"checkpoints": 2})
    decoded = STATE_DECODER.decode(STATE_ENCODER.encode(state))
    assert decoded == state
    resumed = ExperienceBuffer(max_staleness=buf.max_staleness, dedup_window=window)
    resumed.restore(decoded)
    return resumed


def test_the_window_survives_a_checkpoint_and_queued_groups_are_read_again():
    buf = ExperienceBuffer(max_staleness=1, dedup_window=100)
    for offset in range(4):
        buf.offer(group(f"g{offset}"), P0, offset)
    buf.offer(group("g9"), P0, 4)  # a duplicate: counted, not buffered
    buf.offer(group("h0"), P1, 0)
    assert buf.offer(group("g0"), P1, 1) is False
    assert [g.id for g in buf.take(3)] == ["g0", "g1", "g2"]  # g3, g9 and h0 stay buffered

    resumed = _restored(buf, window=100)
    assert resumed.resume_offsets() == {P0: 3, P1: 0}  # carried over before anything is read
    assert resumed.duplicates_dropped == 1 and resumed.stale_dropped == 0
    assert len(resumed) == 0
    # the restart reads from the resume offsets: what was buffered is taken again ...
    assert resumed.offer(group("g3"), P0, 3) is True
    assert resumed.offer(group("g9"), P0, 4) is True
    assert resumed.offer(group("h0"), P1, 0) is True
    # ... the duplicate after h0 is dropped again, and so are copies of trained groups
    assert resumed.offer(group("g0"), P1, 1) is False
    assert resumed.offer(group("g2", exp_ids=["x#0", "g1#1"]), P1, 2) is False
    assert resumed.duplicates_dropped == 3
    assert [g.id for g in resumed.take(3)] == ["g3", "g9", "h0"]


def test_a_smaller_window_on_resume_keeps_the_newest_ids():
    buf = ExperienceBuffer(max_staleness=1, dedup_window=100)
    for offset in range(5):
        buf.offer(group(f"g{offset}"), P0, offset)
    buf.take(5)
    resumed = _restored(buf, window=4)
    assert len(resumed.seen) == 4
    assert resumed.offer(group("g3"), P0, 5) is False
    assert resumed.offer(group("g4"), P0, 6) is False
    assert resumed.offer(group("g2"), P0, 7) is True


def test_checkpoint_state_stays_bounded_after_a_million_ids():
    window = TrainerConfig().dedup_window
    buf = ExperienceBuffer(max_staleness=1)  # trainer.dedup_window's default
    consumed = 10**6
    buf.seen.add(
        id_digest(f"run-20261122/task-{i // 8}@{i // 800}#{i % 8}") for i in range(consumed)
    )
    assert len(buf.seen) == window
    for p in range(4):  # one buffered group per partition: its ids are left out
        buf.offer(group(f"queued-{p}"), ("run.experiences", p), consumed // 32)
    state = buf.state(step=consumed // 256, version=3900, counters={"checkpoints": 78})
    size = len(STATE_ENCODER.encode(state))
    # 8 bytes per remembered id, base64 (4/3), plus a few hundred bytes of the rest
    bound = DIGEST_SIZE * window * 4 // 3 + 1024
    print(f"\ncheckpoint state after {consumed} consumed ids: {size} bytes (bound {bound})")
    assert size < bound < 2 * 1024 * 1024
    # the newest ids are the ones remembered
    last = f"run-20261122/task-{(consumed - 1) // 8}@{(consumed - 1) // 800}#{(consumed - 1) % 8}"
    assert buf.seen.any_of([id_digest(last)])
    assert not buf.seen.any_of([id_digest("run-20261122/task-0@0#0")])


def test_a_skipped_record_counts_as_consumed():
    buf = ExperienceBuffer(max_staleness=1)
    buf.skip(P0, 4)  # dead-lettered: nothing buffered, resume after it
    assert buf.resume_offsets() == {P0: 5}
    buf.offer(group("a"), P0, 5)
    buf.skip(P0, 6)
    assert buf.resume_offsets() == {P0: 5}  # "a" is still buffered
    buf.skip(P0, 2)  # an older record read again never moves the offset back
    buf.take(1)
    assert buf.resume_offsets() == {P0: 7}
