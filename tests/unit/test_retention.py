"""Which versions a run keeps (``synchronizer.keep_versions``), and what a view forgets:
retired versions (never the newest), and sync requests past one per explorer."""

from __future__ import annotations

import pytest

from streamrft.infra.bus import MAX_REQUESTERS, ControlView
from streamrft.infra.config import from_dict, with_run_id
from streamrft.schemas.events import ModelVersionReady, SyncRequest, VersionsRetired
from streamrft.sync.retention import needed, to_retire
from tests.helpers.configs import cfg_of

pytestmark = pytest.mark.unit


def _v(version: int, delta_base: int = -1, lora: bool = False, base: int = -1):
    return ModelVersionReady(
        version=version, method="object_store", uri=f"s3://b/r/v{version:08d}/manifest.json",
        manifest_sha256="0" * 64, bytes=8, step=version, delta_base=delta_base, lora=lora,
        base_version=base,
    )  # fmt: skip


def _shm(version: int):
    return ModelVersionReady(
        version=version, method="shared", uri=f"shm://host/streamrft-r-1-{version % 2}",
        manifest_sha256="0" * 32, bytes=8, step=version,
    )  # fmt: skip


def _one_place(events: dict) -> dict:
    """Versions announced once each (a single method)."""
    return {v: [e] for v, e in events.items()}


def test_full_versions_keep_the_newest():
    versions = _one_place({v: _v(v) for v in range(10)})
    assert to_retire(versions, 3) == list(range(7))
    assert to_retire(versions, 10) == [] and to_retire(versions, 50) == []
    assert to_retire(versions, 0) == []  # 0: keep every version
    assert to_retire({}, 3) == []


def test_a_kept_delta_keeps_its_chain_down_to_the_full_version():
    # 0 full, 1-3 deltas on the one before, 4 full, 5 a delta on 4
    bases = {0: -1, 1: 0, 2: 1, 3: 2, 4: -1, 5: 4}
    versions = _one_place({v: _v(v, b) for v, b in bases.items()})
    assert needed(versions, 2) == {4, 5}
    assert to_retire(versions, 2) == [0, 1, 2, 3]
    upto3 = {v: versions[v] for v in range(4)}
    assert to_retire(upto3, 1) == []  # 3 is rebuilt from 0 through 1 and 2
    with_4 = {v: versions[v] for v in range(5)}
    assert to_retire(with_4, 2) == []  # 3 (kept) still needs its chain


def test_a_kept_adapter_keeps_its_base():
    versions = _one_place({0: _v(0), 1: _v(1, lora=True, base=0), 2: _v(2, lora=True, base=0)})
    assert to_retire(versions, 1) == [1]
    versions[3] = [_v(3)]  # a new full base
    versions[4] = [_v(4, lora=True, base=3)]
    assert to_retire(versions, 2) == [0, 1, 2]


def test_each_place_keeps_its_newest_and_a_store_copy_on_its_way_is_pinned():
    """``auto``: every version in shared memory, a slow store lane copies a few of them
    later. The store's newest ``keep`` copies stay whatever the age of their numbers, and
    the version the lane is writing (pinned) is never retired under it."""
    keep = 2
    versions = {v: [_shm(v)] for v in range(20)}
    for v in (0, 7, 14):  # the store copies announced so far
        versions[v].append(_v(v))
    assert needed(versions, keep) == {18, 19, 7, 14}
    assert to_retire(versions, keep) == [v for v in range(18) if v not in (7, 14)]
    # the lane is writing 19's copy... and, once shared memory moved on, still is
    versions.update({v: [_shm(v)] for v in range(20, 30)})
    retire = to_retire(versions, keep, pinned={19})
    assert 19 not in retire and 7 not in retire and 14 not in retire
    assert retire == [v for v in range(28) if v not in (7, 14, 19)]
    # the copy announced: the store's newest two are 14 and 19; 7 can go
    versions[19].append(_v(19))
    assert to_retire(versions, keep) == [v for v in range(28) if v not in (14, 19)]
    # pinned numbers not announced count for nothing; keep 0 keeps everything
    assert to_retire(versions, keep, pinned={99}) == to_retire(versions, keep)
    assert to_retire(versions, 0, pinned={19}) == []


def test_a_pinned_delta_keeps_its_chain():
    bases = {0: -1, 1: 0, 2: 1, 3: -1, 4: 3}
    versions = _one_place({v: _v(v, b) for v, b in bases.items()})
    assert to_retire(versions, 1) == [0, 1, 2]
    assert to_retire(versions, 1, pinned={2}) == []  # 2 is rebuilt from 0 through 1


def _view() -> ControlView:
    cfg = with_run_id(from_dict(cfg_of()), "retention")
    return ControlView(cfg, "explorer-0", lambda _rec: None)


def test_a_view_forgets_retired_versions_but_never_the_newest():
    view = _view()
    for v in range(5):
        view._on_control(_v(v))
    view._on_control(VersionsRetired(versions=[0, 1, 4]))
    assert sorted(view.versions) == [2, 3, 4]  # 4 is the newest: a forged retirement
    assert view.retired == {0, 1}
    assert view.announcements(0) == []
    view._on_control(_v(1))  # an announcement replayed after its retirement
    assert sorted(view.versions) == [2, 3, 4]


def test_sync_requests_take_one_entry_per_explorer():
    view = _view()
    for n in range(10_000):  # a flood from one name
        view._on_control(SyncRequest(explorer="explorer-1", min_version=n % 7))
    assert [r.min_version for r in view.requests_above(-1)] == [6]  # its highest
    for n in range(MAX_REQUESTERS + 50):  # names made up
        view._on_control(SyncRequest(explorer=f"x-{n}", min_version=3))
    assert len(view.requests_above(-1)) == MAX_REQUESTERS
    assert view.requests_above(5) == []


def test_a_retirement_is_validated_like_any_control_event():
    from streamrft.schemas import CONTROL, SchemaError
    from streamrft.schemas.limits import MAX_RETIRED_PER_EVENT

    ok = VersionsRetired(versions=[0, 3], created_at=1.7e9)
    assert CONTROL.decode(CONTROL.encode(ok)) == ok
    for bad, why in (
        (VersionsRetired(versions=[-1], created_at=1.7e9), "a negative version"),
        (VersionsRetired(versions=[1] * (MAX_RETIRED_PER_EVENT + 1)), "more than"),
    ):
        with pytest.raises(SchemaError, match=why):
            CONTROL.decode(CONTROL.encode(bad))


def test_a_retirement_of_versions_not_announced_is_ignored():
    """A retirement cannot freeze a view ahead of time: versions not announced yet stay
    announceable."""
    view = _view()
    view._on_control(_v(0))
    view._on_control(VersionsRetired(versions=list(range(1, 1000))))
    view._on_control(_v(1))
    view._on_control(_v(2))
    assert sorted(view.versions) == [0, 1, 2] and view.retired == set()
