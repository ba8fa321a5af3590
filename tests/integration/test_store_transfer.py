"""The object store's bulk path against the real S3 server: shards sent as tensor views in
multipart uploads (presigned, unsigned payload), fetched as parallel ranges into one buffer
and decoded in place; every byte still verified."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load as st_load

from streamrft.schemas import IntegrityError, SyncError, decode_manifest
from streamrft.schemas.errors import StoreUnavailable
from streamrft.sync.object_store import (
    ObjectStoreLoader,
    ObjectStorePublisher,
    S3Store,
    parse_uri,
)

pytestmark = pytest.mark.integration

MIB = 1 << 20


def mixed_tensors() -> dict[str, torch.Tensor]:
    """~17 MiB of every common dtype, sizes that cut parts mid-tensor, an empty tensor and a
    scalar, in an order whose dtypes the file must reorder for alignment."""
    gen = torch.Generator().manual_seed(7)
    return {
        "a.bf16": torch.randn(1000, 1001, generator=gen).to(torch.bfloat16),
        "b.int8": torch.randint(-128, 127, (12_345,), generator=gen, dtype=torch.int8),
        "c.f32": torch.randn(2_500_001, generator=gen),
        "d.i64": torch.randint(0, 1 << 40, (300_000,), generator=gen),
        "e.bool": torch.rand(777, generator=gen) > 0.5,
        "f.empty": torch.zeros(0, 4),
        "g.scalar": torch.tensor(3.25, dtype=torch.float64),
        "h.f16": torch.randn(1_000_003, generator=gen).half(),
    }


def store_cfg(make_config, **fields):
    return make_config(object_store={"part_size_mb": 5, "parallel": 3, **fields}).object_store


def shard_keys(client, event) -> list[tuple[str, int]]:
    bucket, key = parse_uri(event.uri)
    manifest = decode_manifest(client.get_object(bucket, key).read())
    prefix = key.rsplit("/", 1)[0]
    return [(f"{prefix}/{s.name}", s.bytes) for s in manifest.shards]


def test_multipart_round_trip_is_bit_exact_and_stays_a_safetensors_file(make_config):
    cfg = store_cfg(make_config, shard_size_mb=9)
    tensors = mixed_tensors()
    publisher = ObjectStorePublisher(cfg, "mp-run")
    event = publisher.publish(tensors, version=1, step=1)
    keys = shard_keys(publisher.client, event)
    assert len(keys) >= 2 and max(size for _, size in keys) > 5 * MIB  # multipart shards
    got = ObjectStoreLoader(cfg).fetch(event)
    assert got.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    # what the store holds is a plain safetensors file, the library reads it as it is
    from_library: dict[str, torch.Tensor] = {}
    for key, size in keys:
        data = publisher.client.get_object(cfg.bucket, key).read()
        assert len(data) == size
        from_library.update(st_load(data))
    assert all(torch.equal(from_library[n], t) for n, t in tensors.items())


def test_a_corrupted_part_or_a_truncated_shard_is_rejected(make_config):
    cfg = store_cfg(make_config)
    tensors = {"w": torch.randn(4 * MIB)}  # one 16 MiB shard: four 5 MiB parts
    publisher = ObjectStorePublisher(cfg, "corrupt-run")
    event = publisher.publish(tensors, version=1, step=1)
    ((key, size),) = shard_keys(publisher.client, event)
    data = bytearray(publisher.client.get_object(cfg.bucket, key).read())
    data[7 * MIB + 3] ^= 0x10  # one bit in the second part
    publisher.client.put_object(cfg.bucket, key, io.BytesIO(bytes(data)), len(data))
    with pytest.raises(IntegrityError, match="sha256"):
        ObjectStoreLoader(cfg).fetch(event)
    publisher.client.put_object(cfg.bucket, key, io.BytesIO(bytes(data[:-1])), size - 1)
    with pytest.raises(IntegrityError, match=f"{size - 1} bytes, the manifest says {size}"):
        ObjectStoreLoader(cfg).fetch(event)


def test_store_errors_name_the_cause_and_are_not_retriable(make_config):
    cfg = store_cfg(make_config)
    store = S3Store(cfg, create_bucket=True)
    with pytest.raises(SyncError, match="NoSuchKey") as missing:
        store.get_hashed("no/such/key", 10)
    assert not isinstance(missing.value, StoreUnavailable)
    import msgspec

    elsewhere = S3Store(msgspec.structs.replace(cfg, bucket="no-such-bucket-x1"), False)
    big = memoryview(bytes(6 * MIB))  # multipart: the upload itself is refused
    with pytest.raises(SyncError, match="NoSuchBucket") as refused:
        elsewhere.write("k", [big], "application/octet-stream")
    assert not isinstance(refused.value, StoreUnavailable)


def test_single_put_and_many_ranges_agree(make_config):
    """Part size above the shard: one PUT; then read back in 5 MiB ranges."""
    tensors = mixed_tensors()
    cfg_one = store_cfg(make_config, part_size_mb=64, parallel=1)
    event = ObjectStorePublisher(cfg_one, "one-run").publish(tensors, 1, 1)
    cfg_ranges = msgspec_replace(cfg_one, part_size_mb=5, parallel=4)
    got = ObjectStoreLoader(cfg_ranges).fetch(event)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def msgspec_replace(obj, **kw):
    import msgspec

    return msgspec.structs.replace(obj, **kw)


def test_a_store_that_ignores_range_requests_is_refused_not_misread(make_config, tmp_path):
    """An HTTP server that answers every ranged GET with the whole object (the standard
    library's, which ignores ``Range``): the download fails with an error that says so,
    rather than filling later ranges with the object's first bytes."""
    import functools
    import hashlib
    import http.server
    import os
    import threading

    data = os.urandom(11 * MIB)  # three 5 MiB ranges
    (tmp_path / "bkt").mkdir()
    (tmp_path / "bkt" / "shard").write_bytes(data)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = store_cfg(make_config, endpoint=f"127.0.0.1:{server.server_port}", bucket="bkt")
        store = S3Store(cfg, create_bucket=False)
        try:
            buf, digest = store.get_hashed("shard", len(data))
        except SyncError as exc:
            assert "Range" in str(exc) and not isinstance(exc, StoreUnavailable)
        else:  # a store that ignores Range may only be read right, never misread
            assert digest == hashlib.sha256(data).hexdigest() and bytes(buf.numpy()) == data
    finally:
        server.shutdown()
        server.server_close()


def test_a_failed_multipart_upload_is_aborted(make_config):
    """An upload that fails after it was started (here a piece that cannot be sent: not
    contiguous) leaves no multipart upload behind on the store, and the error is raised."""
    import numpy as np

    cfg = store_cfg(make_config)
    store = S3Store(cfg, create_bucket=True)
    good = memoryview(bytes(6 * MIB))
    strided = memoryview(np.zeros(2 * MIB, np.uint8)[::2])  # not contiguous
    with pytest.raises(TypeError):
        store.write("v/shard", [good, strided], "application/octet-stream")
    left = store.client._list_multipart_uploads(cfg.bucket, prefix="v/")
    assert [u.upload_id for u in left.uploads] == []


def test_a_killed_trainers_unfinished_uploads_are_aborted_at_the_next_start(make_config):
    """A multipart upload started and never completed (its trainer killed mid-shard) keeps
    its parts in the store, where no listing shows them; the next trainer aborts it before
    its first version, and only this run's."""
    cfg = store_cfg(make_config)
    store = S3Store(cfg, create_bucket=True)

    def start_upload(key: str) -> str:
        resp = store._request("test", "POST", key, query={"uploads": ""})
        upload_id = resp.data.split(b"<UploadId>")[1].split(b"</UploadId>")[0].decode()
        part = [memoryview(b"p" * (5 * MIB))]
        store._put_part("test", key, upload_id, 1, part)
        return upload_id

    def unfinished(prefix: str) -> list[str]:
        page = store.client._list_multipart_uploads(cfg.bucket, prefix=prefix)
        return [u.object_name for u in page.uploads]

    start_upload("left-run/v00000003/shard-0.safetensors")
    start_upload("left-run/v00000003/shard-1.safetensors")
    start_upload("left-run2/v00000001/shard-0.safetensors")
    assert len(unfinished("left-run/")) == 2

    publisher = ObjectStorePublisher(cfg, "left-run")
    assert publisher.remove_leftovers() == 2
    assert unfinished("left-run/") == []
    assert unfinished("left-run2/") == ["left-run2/v00000001/shard-0.safetensors"]
    assert publisher.remove_leftovers() == 0
