"""Benchmark: one weight version through the object store, trainer to explorer model.

Starts the local JuiceFS S3 gateway (``LocalServices``, object store only, in a temporary
folder that is removed afterwards), builds a random float32 state dict of ``--mb`` MiB
(25 tensors of equal size) and times the three phases of the ``object_store`` sync method,
each through the library code:

- ``publish_s``: ``ObjectStorePublisher.publish(tensors, version, step)``: safetensors
  serialisation into shards, sha256 of each shard, multipart uploads, then the manifest;
- ``fetch_verify_s``: ``ObjectStoreLoader.fetch(event)``: download and check the manifest
  against the event's digest, download each shard, check its sha256, decode it to tensors;
- ``apply_s``: ``streamrft.sync.weights.apply_state_dict`` into an ``nn.ParameterDict`` of
  the same names and shapes (name/shape checks, then ``copy_`` of every tensor).

Baseline, same run and same disk: the publisher's safetensors bytes (produced by
``shard_state_dict``, untimed) are written to a file (``write_s``: open, write, close; no
fsync), the file is copied with ``shutil.copyfile`` (``copy_s``) and the copy is read back
(``read_s``, reported but not in ``copy_mb_s``).

Figures (MB = MiB = 2**20 bytes of tensor data; the safetensors header adds ~1 KiB):

- ``mb_s`` = MB / (``publish_s`` + ``fetch_verify_s`` + ``apply_s``): trainer tensors to
  explorer parameters through the object store;
- ``copy_mb_s`` = MB / (``write_s`` + ``copy_s``): the same bytes written once and copied
  once on the local file system (page cache; a floor for any local file handoff);
- ``ratio_vs_copy`` = ``mb_s`` / ``copy_mb_s``;
- informational: ``serialize_s`` and ``sha256_s`` (shard_state_dict and one sha256 pass
  over the shard bytes, timed separately) show how much of ``publish_s`` is CPU work
  outside the upload itself.

Everything runs with one torch/OMP thread. A figure, not a test: the only check is that
the applied parameters equal the published tensors bit for bit.

Usage: ``python bench/weight_sync.py [--mb 500] [--quick]``. Human-readable lines first,
then one JSON line on stdout.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import hashlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from streamrft.infra.config import ObjectStoreConfig
from streamrft.infra.services import LocalServices
from streamrft.sync.object_store import ObjectStoreLoader, ObjectStorePublisher
from streamrft.sync.weights import apply_state_dict, shard_state_dict

MIB = 1 << 20
N_TENSORS = 25
ROW = 4096


def say(msg: str) -> None:
    print(msg, flush=True)


def make_tensors(mb: float, seed: int) -> dict[str, torch.Tensor]:
    """``N_TENSORS`` random float32 tensors of ~``mb`` MiB in all (2-D when sizes allow)."""
    numel = max(1, round(mb * MIB / 4 / N_TENSORS))
    shape = (numel // ROW, ROW) if numel % ROW == 0 else (numel,)
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layer{i:02d}_weight": torch.randn(shape, generator=gen, dtype=torch.float32)
        for i in range(N_TENSORS)
    }


def object_store_path(
    cfg: ObjectStoreConfig, tensors: dict[str, torch.Tensor], run_id: str
) -> dict[str, float]:
    publisher = ObjectStorePublisher(cfg, run_id)  # creates the bucket: untimed
    loader = ObjectStoreLoader(cfg)
    model = nn.ParameterDict(
        {k: nn.Parameter(torch.zeros_like(v), requires_grad=False) for k, v in tensors.items()}
    )

    t0 = time.perf_counter()
    event = publisher.publish(tensors, version=1, step=1)
    t1 = time.perf_counter()
    fetched = loader.fetch(event)
    t2 = time.perf_counter()
    apply_state_dict(model, fetched)
    t3 = time.perf_counter()

    del fetched
    for name, tensor in tensors.items():
        if not torch.equal(model[name], tensor):
            raise RuntimeError(f"{name}: applied parameter differs from the published tensor")
    return {
        "publish_s": t1 - t0,
        "fetch_verify_s": t2 - t1,
        "apply_s": t3 - t2,
        "shard_bytes": float(event.bytes),
    }


def copy_baseline(shards: list[bytes], folder: Path) -> dict[str, float]:
    folder.mkdir(parents=True, exist_ok=True)
    write_s = copy_s = read_s = 0.0
    try:
        for i, data in enumerate(shards):
            src, dst = folder / f"src-{i:05d}.safetensors", folder / f"dst-{i:05d}.safetensors"
            t0 = time.perf_counter()
            with open(src, "wb") as f:
                f.write(data)
            t1 = time.perf_counter()
            shutil.copyfile(src, dst)
            t2 = time.perf_counter()
            back = dst.read_bytes()
            t3 = time.perf_counter()
            if back != data:
                raise RuntimeError(f"{dst}: read back differs from what was written")
            del back
            write_s += t1 - t0
            copy_s += t2 - t1
            read_s += t3 - t2
            src.unlink()
            dst.unlink()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"write_s": write_s, "copy_s": copy_s, "read_s": read_s}


def run(store: ObjectStoreConfig, mb: float, seed: int, scratch: Path) -> dict:
    t = time.perf_counter()
    tensors = make_tensors(mb, seed)
    data_bytes = sum(v.numel() * v.element_size() for v in tensors.values())
    mb_real = data_bytes / MIB
    shape = tuple(next(iter(tensors.values())).shape)
    say(
        f"state dict: {len(tensors)} float32 tensors of shape {shape},"
        f" {mb_real:.1f} MB, made in {time.perf_counter() - t:.1f} s"
    )

    run_id = f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    osp = object_store_path(store, tensors, run_id)
    total_s = osp["publish_s"] + osp["fetch_verify_s"] + osp["apply_s"]
    say(
        f"object store: publish {osp['publish_s']:.2f} s, fetch+verify"
        f" {osp['fetch_verify_s']:.2f} s, apply {osp['apply_s']:.2f} s"
        f" -> {mb_real / total_s:.0f} MB/s over {total_s:.2f} s"
    )

    t0 = time.perf_counter()
    shards = [data for _names, data in shard_state_dict(tensors, store.shard_size_mb * MIB)]
    t1 = time.perf_counter()
    for data in shards:
        hashlib.sha256(data).hexdigest()
    t2 = time.perf_counter()
    serialize_s, sha256_s = t1 - t0, t2 - t1
    del tensors
    base = copy_baseline(shards, scratch / "copy-baseline")
    shard_bytes = sum(len(s) for s in shards)
    n_shards = len(shards)
    del shards
    copy_total = base["write_s"] + base["copy_s"]
    say(
        f"file baseline ({shard_bytes / MIB:.1f} MB of safetensors): write {base['write_s']:.2f} s,"
        f" copyfile {base['copy_s']:.2f} s -> {mb_real / copy_total:.0f} MB/s;"
        f" read back {base['read_s']:.2f} s"
    )
    say(f"for reference: serialize {serialize_s:.2f} s, one sha256 pass {sha256_s:.2f} s")

    mb_s = mb_real / total_s
    copy_mb_s = mb_real / copy_total
    return {
        "bench": "weight_sync",
        "method": "object_store",
        "mb": round(mb_real, 1),
        "publish_s": round(osp["publish_s"], 3),
        "fetch_verify_s": round(osp["fetch_verify_s"], 3),
        "apply_s": round(osp["apply_s"], 3),
        "mb_s": round(mb_s, 1),
        "copy_mb_s": round(copy_mb_s, 1),
        "ratio_vs_copy": round(mb_s / copy_mb_s, 4),
        "write_s": round(base["write_s"], 3),
        "copy_s": round(base["copy_s"], 3),
        "read_s": round(base["read_s"], 3),
        "serialize_s": round(serialize_s, 3),
        "sha256_s": round(sha256_s, 3),
        "shards": n_shards,
        "shard_bytes": int(osp["shard_bytes"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=None, help="state dict MiB (default 500)")
    ap.add_argument("--quick", action="store_true", help="tiny run (8 MiB)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    mb = args.mb if args.mb is not None else (8.0 if args.quick else 500.0)
    if mb <= 0:
        ap.error("--mb must be > 0")
    torch.set_num_threads(1)

    # SIGTERM -> SystemExit so that the finally block below stops the services
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="streamrft-bench-weights-"))
    services = LocalServices(tmp / "services", broker=False, object_store=True)
    try:
        eps = services.start()
        store = ObjectStoreConfig(
            endpoint=eps.s3_endpoint,
            access_key=eps.access_key or "",
            secret_key=eps.secret_key or "",
        )
        say(f"object store at {eps.s3_endpoint} (JuiceFS gateway), {mb:g} MB, torch threads 1")
        result = run(store, mb, args.seed, tmp)
    finally:
        services.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    say(
        f"overall: {result['mb_s']} MB/s via object store, {result['copy_mb_s']} MB/s file copy,"
        f" ratio {result['ratio_vs_copy']} (wall {time.perf_counter() - t_start:.1f} s)"
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
