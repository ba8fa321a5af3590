"""Who counts as working for the trainer's idle timeout: explorers heard from lately,
RUNNING, with tasks in hand (``StatusEvent.working``)."""

from __future__ import annotations

import time

import pytest

from streamrft.infra.bus import ControlView
from streamrft.infra.config import from_dict, with_run_id
from streamrft.schemas.events import RunState, StatusEvent
from tests.helpers.configs import cfg_of

pytestmark = pytest.mark.unit


def _status(name: str, state: RunState, working: bool, role: str = "explorer") -> StatusEvent:
    return StatusEvent(
        component=name, role=role, state=state, step=1, version=0, created_at=time.time(),
        working=working,
    )  # fmt: skip


def test_working_peers_are_running_explorers_with_tasks_in_hand():
    view = ControlView(with_run_id(from_dict(cfg_of()), "live"), "trainer", lambda _r: None)
    view._on_status(_status("explorer-0", RunState.RUNNING, True))
    view._on_status(_status("explorer-1", RunState.RUNNING, False))  # between steps
    view._on_status(_status("explorer-2", RunState.WAITING_SYNC, True))  # waits on us
    view._on_status(_status("explorer-3", RunState.STOPPED, True))
    view._on_status(_status("feeder", RunState.RUNNING, True, role="feeder"))
    # a serve process with episodes waiting for rewards (or groups in its spool) works too
    view._on_status(_status("serve-1-ab", RunState.RUNNING, True, role="serve"))
    view._on_status(_status("serve-2-cd", RunState.RUNNING, False, role="serve"))
    assert view.working_peers(30) == ["explorer-0", "serve-1-ab"]
    view._peer_seen["explorer-0"] -= 60  # not heard from for a minute
    view._peer_seen["serve-1-ab"] -= 60
    assert view.working_peers(30) == []


def test_a_rejection_carries_at_most_500_characters_of_reason():
    from streamrft.schemas.events import ModelVersionReady
    from streamrft.sync.follower import REJECTION_TEXT_CHARS, _rejection

    event = ModelVersionReady(
        version=3, method="m" * 1000, uri="s3://b/k", manifest_sha256="ab" * 32, bytes=1, step=3
    )
    r = _rejection(event, "x" * 5000, "refused")
    assert len(r.reason) == REJECTION_TEXT_CHARS + 3 and r.reason.endswith("...")
    assert len(r.method) == REJECTION_TEXT_CHARS and r.kind == "refused"
    assert _rejection(event, "short", "integrity").reason == "short"


def test_a_run_without_explorers_of_its_own_waits_for_the_first_one():
    """``explorer.count`` 0: until an explorer is heard from, the idle clock never runs out
    (one started elsewhere may take minutes to load a model); after that, the rule is the
    usual one. A run that starts explorers itself waits for none."""
    from types import SimpleNamespace

    from streamrft.consumers.trainer import Trainer

    for count, waits in ((0, True), (1, False)):
        cfg = with_run_id(from_dict(cfg_of(explorer={"count": count})), "live")
        view = ControlView(cfg, "trainer", lambda _r: None)
        trainer = SimpleNamespace(view=view, cfg=cfg)
        assert Trainer._explorers_working(trainer) is waits
        view._on_status(_status("feeder", RunState.RUNNING, True, role="feeder"))
        assert Trainer._explorers_working(trainer) is waits  # a feeder is no explorer
        view._on_status(_status("explorer-x", RunState.RUNNING, False))  # between steps
        assert view.heard_from("explorer") and not Trainer._explorers_working(trainer)
        view._on_status(_status("explorer-x", RunState.RUNNING, True))
        assert Trainer._explorers_working(trainer)
