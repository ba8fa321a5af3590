"""Pure parts of the collective weight sync: rendezvous uris, bucket plans, (un)flattening."""

from __future__ import annotations

import pytest
import torch

from streamrft.schemas.errors import SyncError
from streamrft.sync.collective import (
    Rendezvous,
    TensorSpec,
    flatten_bucket,
    parse_rendezvous,
    plan_buckets,
    rendezvous_uri,
    spec_digest,
    tensor_specs,
    unflatten_bucket,
)

pytestmark = pytest.mark.unit


def test_rendezvous_round_trip():
    uri = rendezvous_uri("gloo", "127.0.0.1", 29500, 17, ["explorer-0", "explorer-1"])
    assert uri == "gloo://127.0.0.1:29500/17?members=explorer-0,explorer-1"
    rdv = parse_rendezvous(uri)
    assert rdv == Rendezvous("gloo", "127.0.0.1", 29500, 17, ("explorer-0", "explorer-1"))
    assert rdv.world_size == 3
    assert rdv.rank_of("explorer-0") == 1 and rdv.rank_of("explorer-1") == 2
    assert rdv.uri == uri
    with pytest.raises(SyncError, match="not a member"):
        rdv.rank_of("explorer-9")


def test_rendezvous_odd_members_and_ipv6():
    members = ["a,b", "c d", "é/?&=", "x%y"]
    uri = rendezvous_uri("nccl", "::1", 1, 0, members)
    rdv = parse_rendezvous(uri)
    assert rdv.host == "::1" and rdv.port == 1 and rdv.backend == "nccl"
    assert rdv.members == tuple(members)


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "tcp://127.0.0.1:1/1?members=a",  # unknown backend
        "gloo://127.0.0.1/1?members=a",  # no port
        "gloo://127.0.0.1:0/1?members=a",  # port 0 is never a real rendezvous
        "gloo://127.0.0.1:70000/1?members=a",  # port out of range
        "gloo://127.0.0.1:x/1?members=a",
        "gloo://:5/1?members=a",  # no host
        "gloo://127.0.0.1:5/?members=a",  # no epoch
        "gloo://127.0.0.1:5/-1?members=a",
        "gloo://127.0.0.1:5/1x?members=a",
        "gloo://127.0.0.1:5/1/2?members=a",
        "gloo://127.0.0.1:5/1",  # no members
        "gloo://127.0.0.1:5/1?members=",
        "gloo://127.0.0.1:5/1?members=a,,b",
        "gloo://127.0.0.1:5/1?members=a,a",  # duplicate
        "gloo://127.0.0.1:5/1?members=a&x=1",  # unknown key
        "gloo://127.0.0.1:5/1?members=a#frag",
        "gloo://u:p@127.0.0.1:5/1?members=a",
    ],
)
def test_malformed_rendezvous_rejected(uri):
    with pytest.raises(SyncError):
        parse_rendezvous(uri)


@pytest.mark.parametrize(
    "args",
    [
        ("mpi", "h", 1, 1, ["a"]),
        ("gloo", "", 1, 1, ["a"]),
        ("gloo", "h", 0, 1, ["a"]),
        ("gloo", "h", 1, -1, ["a"]),
        ("gloo", "h", 1, 1, []),
        ("gloo", "h", 1, 1, ["a", "a"]),
        ("gloo", "h", 1, 1, [""]),
    ],
)
def test_bad_rendezvous_parts_rejected(args):
    with pytest.raises(SyncError):
        rendezvous_uri(*args)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 33, generator=g),
        "b": torch.randn(33, generator=g),
        "bf": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "t": torch.randn(40, 30, generator=g).t(),  # non-contiguous
        "ids": torch.randint(-(2**40), 2**40, (77,), generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "mask": torch.rand(9, generator=g) > 0.5,
    }


def test_spec_digest_is_order_free_and_sensitive():
    a = _tensors()
    b = dict(reversed(list(a.items())))
    assert [s.name for s in tensor_specs(b)] == sorted(a)
    assert spec_digest(tensor_specs(a)) == spec_digest(tensor_specs(b))
    for change in (
        {"b": torch.zeros(34)},  # shape
        {"b": torch.zeros(33, dtype=torch.float64)},  # dtype
        {"b2": torch.zeros(33)},  # an extra name
    ):
        other = {**a, **change}
        assert spec_digest(tensor_specs(other)) != spec_digest(tensor_specs(a))


@pytest.mark.parametrize("bucket_bytes", [1, 7, 100, 1000, 4096, 1 << 20])
def test_plan_covers_every_element_once(bucket_bytes):
    specs = tensor_specs(_tensors())
    buckets = plan_buckets(specs, bucket_bytes)
    assert buckets == plan_buckets(specs, bucket_bytes)  # deterministic
    seen: dict[str, list[tuple[int, int]]] = {}
    for bucket in buckets:
        item = torch.empty((), dtype=bucket.dtype).element_size()
        assert bucket.nbytes <= max(bucket_bytes, item)
        assert sum(s.numel for s in bucket.segments) == bucket.numel
        offset = 0
        for seg in bucket.segments:
            assert seg.offset == offset and seg.numel > 0
            offset += seg.numel
            seen.setdefault(seg.name, []).append((seg.start, seg.numel))
    for spec in specs:
        ranges = seen.get(spec.name, [])
        pos = 0
        for start, n in ranges:
            assert start == pos
            pos += n
        assert pos == spec.numel
    # one dtype per bucket, each dtype's buckets contiguous in the plan
    order = [str(b.dtype) for b in buckets]
    assert order == sorted(order)


def test_big_tensor_is_split_not_oversized():
    specs = [TensorSpec("big", (1000,), torch.float32), TensorSpec("small", (3,), torch.float32)]
    buckets = plan_buckets(specs, 1024)  # 256 floats a bucket
    assert [b.numel for b in buckets] == [256, 256, 256, 235]
    assert buckets[-1].segments[-1].name == "small"
    with pytest.raises(SyncError):
        plan_buckets(specs, 0)


@pytest.mark.parametrize("bucket_bytes", [1, 100, 1000, 1 << 20])
def test_flatten_unflatten_round_trip_in_place(bucket_bytes):
    src = _tensors(1)
    dst = _tensors(2)
    dst["t"] = torch.zeros(40, 30).t()  # non-contiguous destination split over buckets
    ptrs = {k: v.data_ptr() for k, v in dst.items()}
    staging: dict[str, torch.Tensor] = {}
    specs = tensor_specs(src)
    assert specs == tensor_specs(dst)
    for bucket in plan_buckets(specs, bucket_bytes):
        buf = flatten_bucket(bucket, src)
        assert buf.is_contiguous() and buf.dtype == bucket.dtype and buf.numel() == bucket.numel
        wire = buf.view(torch.uint8).clone()  # what a broadcast carries: bytes
        unflatten_bucket(bucket, wire.view(bucket.dtype), dst, staging)
    assert not staging
    for name, t in src.items():
        assert torch.equal(dst[name], t), name
        assert dst[name].data_ptr() == ptrs[name], name
    assert not dst["t"].is_contiguous()


def test_unflatten_into_parameters_that_require_grad():
    layer = torch.nn.Linear(8, 4)
    src = {k: torch.randn_like(v) for k, v in layer.state_dict().items()}
    own = dict(layer.named_parameters())
    for bucket in plan_buckets(tensor_specs(src), 16):
        unflatten_bucket(bucket, flatten_bucket(bucket, src), own)
    assert torch.equal(layer.weight.detach(), src["weight"])
    assert layer.weight.requires_grad
