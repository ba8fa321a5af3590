"""Pure parts of the collective weight sync: rendezvous uris, bucket plans, (un)flattening."""

from __future__ import annotations

import pytest
import torch

from streamrft.schemas.errors import SyncError
from streamrft.sync.collective import (
    DIRECT_MIN_BYTES,
    Rendezvous,
    Segment,
    TensorSpec,
    direct_view,
    flatten_bucket,
    parse_rendezvous,
    plan_buckets,
    rendezvous_uri,
    sharing_a_device,
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
    # the big tensor in buckets of its own (each from offset 0: sent in place), then the rest
    assert [b.numel for b in buckets] == [256, 256, 256, 232, 3]
    assert all(len(b.segments) == 1 and b.segments[0].name == "big" for b in buckets[:4])
    assert [s.start for b in buckets[:4] for s in b.segments] == [0, 256, 512, 768]
    assert buckets[-1].segments == (Segment("small", 0, 3, 0),)
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


def test_big_tensors_get_buckets_of_their_own_small_ones_share():
    big = DIRECT_MIN_BYTES // 4  # float32 elements of a tensor at the threshold
    specs = tensor_specs(
        {
            "a.big": torch.empty(3 * big),  # 3 MiB: three buckets of its own
            "b.tiny": torch.empty(5),
            "c.half": torch.empty(2 * big, dtype=torch.float16),  # 1 MiB of float16: its own
            "d.tiny": torch.empty(7, dtype=torch.float16),
            "e.below": torch.empty(big // 2),  # below the threshold: packed with b.tiny
        }
    )
    buckets = plan_buckets(specs, DIRECT_MIN_BYTES)
    assert [[(s.name, s.start, s.offset) for s in b.segments] for b in buckets] == [
        [("c.half", 0, 0)],  # float16 first (dtypes in name order), big ones at once
        [("d.tiny", 0, 0)],
        [("a.big", 0, 0)],
        [("a.big", big, 0)],
        [("a.big", 2 * big, 0)],
        [("b.tiny", 0, 0), ("e.below", 0, 5)],
    ]
    # the bucket size still bounds every bucket, big or shared
    assert max(b.nbytes for b in buckets) <= DIRECT_MIN_BYTES
    # a bucket smaller than the threshold makes the threshold the bucket's size
    small = plan_buckets(tensor_specs({"w": torch.empty(64), "v": torch.empty(3)}), 256)
    assert [[(s.name, s.start, s.offset) for s in b.segments] for b in small] == [
        [("w", 0, 0)],
        [("v", 0, 0)],
    ]


def test_direct_view_is_the_tensor_memory_only_when_it_can_be():
    t = torch.arange(3000, dtype=torch.float32)
    specs = tensor_specs({"t": t})
    (b0, b1, b2) = plan_buckets(specs, 4000)  # 1000 floats a bucket, one segment each
    view = direct_view(b1, {"t": t}, torch.device("cpu"))
    assert view is not None and view.data_ptr() == t[1000:].data_ptr() and view.numel() == 1000
    view.fill_(-1)  # a receive into the view lands in the tensor
    assert torch.equal(t[1000:2000], torch.full((1000,), -1.0))
    assert direct_view(b0, {"t": torch.zeros(100, 30).t()}, torch.device("cpu")) is None
    assert direct_view(b2, {"t": t}, torch.device("meta")) is None  # not on the wire's device
    packed = plan_buckets(tensor_specs({"x": torch.zeros(2), "y": torch.zeros(3)}), 1 << 20)
    assert len(packed) == 1 and direct_view(packed[0], {}, torch.device("cpu")) is None


def test_flatten_into_a_given_buffer_and_unflatten_from_the_tensor_itself():
    src = _tensors(3)
    bucket = next(
        b for b in plan_buckets(tensor_specs(src), 1 << 20) if str(b.dtype) == "torch.float32"
    )
    out = torch.full((bucket.numel,), float("nan"))
    assert flatten_bucket(bucket, src, out=out).data_ptr() == out.data_ptr()
    for seg in bucket.segments:
        want = src[seg.name].reshape(-1)[seg.start : seg.start + seg.numel]
        assert torch.equal(out[seg.offset : seg.offset + seg.numel], want)
    # a bucket received in place: unflattening from the tensor's own memory changes nothing
    w = torch.randn(5000)
    before = w.clone()
    (only,) = plan_buckets(tensor_specs({"w": w}), 1 << 20)
    unflatten_bucket(only, direct_view(only, {"w": w}, torch.device("cpu")), {"w": w})
    assert torch.equal(w, before)


@pytest.mark.parametrize(
    ("own", "joined", "apart"),
    [
        ("", {"e0": "", "e1": ""}, []),  # gloo: host memory, any number per host
        ("GPU-a", {"e0": "GPU-b", "e1": "GPU-c"}, []),  # one GPU each
        ("GPU-a", {"e0": "GPU-a", "e1": "GPU-b"}, ["e0"]),  # e0 on the trainer's GPU
        ("GPU-a", {"e0": "GPU-b", "e1": "GPU-b", "e2": "GPU-c"}, ["e0", "e1"]),  # e0, e1 share
        ("GPU-a", {"e0": "GPU-a", "e1": "GPU-a"}, ["e0", "e1"]),  # one-GPU box
        ("", {"e0": "GPU-b", "e1": "GPU-b"}, ["e0", "e1"]),
    ],
)
def test_members_sharing_a_device_are_found(own, joined, apart):
    assert sharing_a_device(own, joined) == apart
