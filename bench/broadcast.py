"""Benchmark: the library's weight broadcast against a raw ``torch.distributed.broadcast``.

One trainer (this process, rank 0) and one explorer (a child process, ``multiprocessing``
spawn context, OMP_NUM_THREADS=1, torch threads 1) on the gloo backend (CPU; NCCL shares
the library's code path). The state dict is ``--mb`` MiB of random float32 in ``--tensors``
(25) tensors of equal size (as ``bench/weight_sync.py``); the child holds zero tensors of
the same names and shapes. The child is started, its tensors allocated and both groups formed before any
timing; it is always stopped afterwards.

Timed after a first library version (group formation, untimed as steady state), in
``--repeats`` rounds of raw flat, raw per tensor, one library version (interleaved, so
machine noise hits all three alike), the best (least) time of each kept:

- ``raw_flat_s``: in a default gloo group of the same two processes
  (``init_process_group``; the library never uses the default group), one
  ``torch.distributed.broadcast`` of a flat uint8 tensor holding all the bytes, received
  into a preallocated flat tensor, then a ``barrier`` so that the time ends when the
  explorer has the bytes (a barrier on both sides, untimed, starts each repeat);
- ``raw_tensors_s``: the same with one ``broadcast`` per tensor, received straight into
  the explorer's tensors;
- ``raw_s``: the better of the two: the baseline;
- ``broadcast_s``: the library's steady state: ``CollectiveSender.broadcast(tensors, v)``
  for versions 2, 3, ... of one epoch, the child in ``CollectiveReceiver.receive`` (it
  tells the trainer it is calling ``receive`` just before, so the time holds no queue
  latency); the ready/go handshake, the header, the bucketed transfer, the explorer's
  copy into its tensors and its confirmation (``broadcast`` returns when it confirmed).
  The child zeroes its tensors between versions; after the last one it hashes (sha256)
  every received tensor: ``bytes_equal`` is true when all match the trainer's.
- ``first_broadcast_s``: version 1 (group formation included; informational).
- phases of the best library version, as the library's ``last_stats`` report them:
  sender ``wait_s`` (ready/go handshake), ``send_s`` (header and buckets: packing,
  broadcasting), ``pack_s`` (part of ``send_s`` spent copying into buckets), ``confirm_s``
  (waiting for the explorer's done key); receiver ``wait_s``, ``recv_s``, ``unpack_s``;
  both: ``buckets`` (broadcast calls) and ``packed`` (those that went through a staging
  buffer rather than in place).

Figures (MB = MiB): ``mb_s`` = MB / ``broadcast_s``, ``raw_mb_s`` = MB / ``raw_s``,
``ratio_vs_raw_broadcast`` = ``raw_s`` / ``broadcast_s`` (1.0: as fast as the raw call);
``median_ratio``: the same with the medians of the rounds (the better raw mode's median).

Usage: ``python bench/broadcast.py [--mb 500] [--tensors 25] [--bucket-mb 64] [--repeats 3]
[--quick]``.
Human-readable lines first, then one JSON line on stdout.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import json
import multiprocessing as mp
import queue
import signal
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from weight_sync import (  # bench/, on the path as the script's folder
    make_tensors,
    say,
    stop_child,
)

from streamrft.sync.collective import CollectiveReceiver, CollectiveSender
from streamrft.sync.weights import sha256_hex

MIB = 1 << 20
TIMEOUT_S = 120.0
MEMBER = "explorer-0"
RAW_MODES = ("flat", "tensors")


def flat_bytes(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1).view(torch.uint8) for n in sorted(tensors)])


# ----------------------------------------------------------------------- explorer child


def _raw(mode: str, tensors: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
    """One raw broadcast (both ranks run this); ends with a barrier."""
    if mode == "flat":
        dist.broadcast(flat, src=0)
    else:
        for name in sorted(tensors):
            dist.broadcast(tensors[name], src=0)
    dist.barrier()


def _explorer(shapes: dict[str, tuple[int, ...]], port: int, commands: Any, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    tensors = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
    flat = torch.zeros(sum(t.numel() * 4 for t in tensors.values()), dtype=torch.uint8)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    receiver = CollectiveReceiver(MEMBER, TIMEOUT_S)
    results.put({"op": "ready"})
    try:
        while True:
            cmd = commands.get()
            if cmd[0] == "exit":
                return
            out: dict[str, Any] = {"op": cmd[0]}
            try:
                if cmd[0] == "raw":
                    dist.barrier()
                    _raw(cmd[1], tensors, flat)
                else:
                    _, uri, version, check = cmd
                    results.put({"op": "receiving"})
                    t0 = time.perf_counter()
                    receiver.receive(uri, tensors, version)
                    out["receive_s"] = time.perf_counter() - t0
                    out["stats"] = dict(getattr(receiver, "last_stats", {}))
                    if check:
                        out["sha256"] = {n: sha256_hex(t) for n, t in tensors.items()}
                for t in tensors.values():  # the next transfer must really arrive
                    t.zero_()
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"[:500]
            results.put(out)
    finally:
        receiver.close()
        dist.destroy_process_group()


def _result(results: Any, proc: Any, timeout_s: float) -> dict[str, Any]:
    """The child's next message; RuntimeError if it dies, stays silent or failed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = results.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"explorer died (exit code {proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"explorer silent for {timeout_s:.0f} s") from None
            continue
        if "error" in out:
            raise RuntimeError(f"explorer: {out['error']}")
        return out


# ------------------------------------------------------------------------------ timing


def time_raw(mode: str, tensors, flat, commands, results, proc) -> float:
    commands.put(("raw", mode))
    dist.barrier()
    t0 = time.perf_counter()
    _raw(mode, tensors, flat)
    elapsed = time.perf_counter() - t0
    _result(results, proc, TIMEOUT_S)
    return elapsed


def time_version(sender, uri, tensors, version: int, check: bool, commands, results, proc):
    """One library version: (seconds, sender stats, the explorer's answer)."""
    commands.put(("lib", uri, version, check))
    if _result(results, proc, TIMEOUT_S)["op"] != "receiving":
        raise RuntimeError("explorer: expected 'receiving'")
    t0 = time.perf_counter()
    sender.broadcast(tensors, version)
    elapsed = time.perf_counter() - t0
    return elapsed, dict(sender.last_stats), _result(results, proc, TIMEOUT_S)


def time_all(sender, tensors, flat, commands, results, proc, repeats: int) -> dict[str, Any]:
    """Version 1 (group formation), then ``repeats`` rounds of raw flat, raw per tensor and
    one library version each (interleaved, so that machine noise hits all three alike)."""
    uri = sender.open_epoch([MEMBER])
    ipc = (commands, results, proc)
    first = time_version(sender, uri, tensors, 1, False, *ipc)[0]
    raw: dict[str, list[float]] = {m: [] for m in RAW_MODES}
    runs = []
    for r in range(repeats):
        for m in RAW_MODES:
            raw[m].append(time_raw(m, tensors, flat, *ipc))
        runs.append(time_version(sender, uri, tensors, r + 2, r == repeats - 1, *ipc))
    want = {n: sha256_hex(t) for n, t in tensors.items()}
    best = min(runs, key=lambda x: x[0])
    return {
        "raw": raw,
        "first_broadcast_s": first,
        "times": [x[0] for x in runs],
        "broadcast_s": best[0],
        "sender": best[1],
        "receiver": best[2].get("stats", {}),
        "receive_s": best[2]["receive_s"],
        "bytes_equal": runs[-1][2]["sha256"] == want,
    }


def run(mb: float, count: int, bucket_mb: float, repeats: int, seed: int) -> dict[str, Any]:
    tensors = make_tensors(mb, seed, count)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    mb_real = nbytes / MIB
    flat = flat_bytes(tensors)
    say(f"state dict: {len(tensors)} float32 tensors, {mb_real:.1f} MB; bucket {bucket_mb} MB")
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=TIMEOUT_S), False)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    proc = ctx.Process(target=_explorer, args=(shapes, store.port, commands, results), daemon=True)
    proc.start()
    sender = None
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2)
        _result(results, proc, 300)
        sender = CollectiveSender("127.0.0.1", 0, TIMEOUT_S, bucket_mb, backend="gloo")
        lib = time_all(sender, tensors, flat, commands, results, proc, repeats)
    finally:
        if sender is not None:
            sender.close()
        stop_child(proc, commands, results)
        if dist.is_initialized():
            dist.destroy_process_group()
    raw = lib["raw"]
    for m in RAW_MODES:
        say(f"raw broadcast ({m}): {', '.join(f'{t:.3f}' for t in raw[m])} s")
    say(
        f"library: first {lib['first_broadcast_s']:.3f} s, steady "
        f"{', '.join(f'{t:.3f}' for t in lib['times'])} s; bytes equal {lib['bytes_equal']}"
    )
    say(f"library phases (best version): sender {lib['sender']}, receiver {lib['receiver']}")
    raw_best = {m: min(raw[m]) for m in RAW_MODES}
    raw_s = min(raw_best.values())
    r4 = lambda x: round(float(x), 4)  # noqa: E731
    return {
        "bench": "weight_sync",
        "method": "nccl",
        "backend": "gloo",
        "ratio_vs_raw_broadcast": r4(raw_s / lib["broadcast_s"]),
        "mb": round(mb_real, 1),
        "tensors": len(tensors),
        "bucket_mb": bucket_mb,
        "repeats": repeats,
        "broadcast_s": r4(lib["broadcast_s"]),
        "raw_s": r4(raw_s),
        "raw_flat_s": r4(raw_best["flat"]),
        "raw_tensors_s": r4(raw_best["tensors"]),
        "mb_s": round(mb_real / lib["broadcast_s"], 1),
        "raw_mb_s": round(mb_real / raw_s, 1),
        "median_ratio": r4(
            min(map(statistics.median, raw.values())) / statistics.median(lib["times"])
        ),
        "first_broadcast_s": r4(lib["first_broadcast_s"]),
        "receive_s": r4(lib["receive_s"]),
        "sender_phases": {k: r4(v) for k, v in lib["sender"].items()},
        "receiver_phases": {k: r4(v) for k, v in lib["receiver"].items()},
        "bytes_equal": lib["bytes_equal"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=None, help="state dict MiB (default 500)")
    ap.add_argument("--quick", action="store_true", help="tiny run (16 MiB)")
    ap.add_argument("--tensors", type=int, default=25, help="number of tensors (equal sizes)")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="library bucket MiB")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each transfer")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    mb = args.mb if args.mb is not None else (16.0 if args.quick else 500.0)
    if mb <= 0 or args.bucket_mb <= 0 or args.repeats < 1 or args.tensors < 1:
        ap.error("--mb and --bucket-mb must be > 0, --repeats and --tensors >= 1")
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    result = run(mb, args.tensors, args.bucket_mb, args.repeats, args.seed)
    say(
        f"overall: library {result['mb_s']} MB/s, raw broadcast {result['raw_mb_s']} MB/s, "
        f"ratio {result['ratio_vs_raw_broadcast']} (wall {time.perf_counter() - t0:.1f} s)"
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
