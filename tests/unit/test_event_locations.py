"""What a control event may make an explorer do: only the methods its run uses, a
rendezvous only at ``synchronizer.nccl_host``, a broadcast only with the digest of its
bytes. Each refusal is an IntegrityError (a rejected version, with its reason), raised
before any connection or allocation."""

from __future__ import annotations

import pytest
import torch

from streamrft.infra.config import from_dict
from streamrft.schemas import IntegrityError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.broadcast import BroadcastReceiver, same_host
from streamrft.sync.collective import rendezvous_uri
from streamrft.sync.transport import Receivers
from tests.helpers.configs import cfg_of

pytestmark = pytest.mark.unit


def _event(method: str, uri: str, **fields) -> ModelVersionReady:
    return ModelVersionReady(
        version=3, method=method, uri=uri, manifest_sha256="0" * 64, bytes=8, step=3, **fields
    )


def _receivers(method: str) -> Receivers:
    return Receivers(from_dict(cfg_of(synchronizer={"method": method})), "explorer-0")


NCCL = rendezvous_uri("gloo", "127.0.0.1", 29500, 1, ["explorer-0"])
EVENTS = {
    "object_store": _event("object_store", "s3://streamrft/run/v00000003/manifest.json"),
    "filesystem": _event("filesystem", "file:///tmp/w/run/v00000003/manifest.json"),
    "nccl": _event("nccl", NCCL, state_sha256="0" * 64),
    "shared": _event("shared", "shm://elsewhere/streamrft-run-1-0"),
}


@pytest.mark.parametrize(
    ("method", "accepted"),
    [
        ("object_store", {"object_store"}),
        ("filesystem", {"filesystem"}),
        ("nccl", {"nccl", "object_store"}),
        ("shared", {"shared"}),
        ("auto", {"shared", "object_store"}),
    ],
)
def test_a_run_loads_only_the_methods_it_uses(method, accepted):
    receivers = _receivers(method)
    for name, event in EVENTS.items():
        if name in accepted:
            continue
        assert not receivers.can_load(event), name
        assert f"synchronizer.method: {method}" in receivers.refusal(event), name
        with pytest.raises(IntegrityError, match=rf"synchronizer\.method: {method}"):
            receivers.for_event(event)


def test_a_rendezvous_elsewhere_or_a_broadcast_without_its_digest_is_refused():
    receiver = BroadcastReceiver("explorer-0", 5.0, "127.0.0.1")
    like = {"w": torch.zeros(2)}
    away = rendezvous_uri("gloo", "10.9.9.9", 29500, 1, ["explorer-0"])
    assert receiver.refusal(_event("nccl", NCCL, state_sha256="0" * 64)) is None
    assert "not synchronizer.nccl_host" in receiver.refusal(_event("nccl", away))
    assert "rendezvous" in receiver.refusal(_event("nccl", "gloo://nowhere"))
    receivers = _receivers("nccl")  # the run's receivers refuse it before any membership
    assert not receivers.can_load(_event("nccl", away, state_sha256="0" * 64))
    assert "not synchronizer.nccl_host" in receivers.refusal(_event("nccl", away))
    with pytest.raises(IntegrityError, match=r"not synchronizer\.nccl_host"):
        receiver.receive(_event("nccl", away, state_sha256="0" * 64), like)
    with pytest.raises(IntegrityError, match="no digest of its bytes"):
        receiver.receive(_event("nccl", NCCL), like)
    assert receiver._receiver is None  # nothing was connected to
    # a host the run lists for a restarted trainer (synchronizer.nccl_hosts) is accepted
    moved = BroadcastReceiver("explorer-0", 5.0, "127.0.0.1", ["10.9.9.8", "10.9.9.9"])
    assert moved.refusal(_event("nccl", away)) is None
    elsewhere = rendezvous_uri("gloo", "10.9.9.7", 29500, 1, ["explorer-0"])
    assert "10.9.9.8, 10.9.9.9" in moved.refusal(_event("nccl", elsewhere))


def test_same_host():
    assert same_host("::1", "[::1]") and same_host("LOCALHOST", "localhost")
    assert same_host("127.0.0.1", "127.0.0.1") and not same_host("127.0.0.1", "127.0.0.2")
