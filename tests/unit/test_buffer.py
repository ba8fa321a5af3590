"""The trainer's experience buffer: dedup, staleness, batching and resume offsets."""

from __future__ import annotations

import pytest

from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.schemas import Experience, ExperienceGroup, pack_f32, pack_i32, pack_u8

pytestmark = pytest.mark.unit

P0 = ("run.experiences", 0)
P1 = ("run.experiences", 1)


def group(
    gid: str, version: int = 0, n: int = 2, exp_ids: list[str] | None = None
) -> ExperienceGroup:
    ids = exp_ids or [f"{gid}#{i}" for i in range(n)]
    return ExperienceGroup(
        id=gid,
        run="run",
        task_id=gid,
        explorer="explorer-0",
        model_version=version,
        experiences=[
            Experience(
                id=i,
                tokens=pack_i32([1, 2, 3]),
                prompt_length=2,
                logprobs=pack_f32([-1.0]),
                action_mask=pack_u8([1]),
                reward=0.0,
                model_version=version,
            )
            for i in ids
        ],
    )


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
