"""Benchmark: experience groups from an explorer-style producer to a trainer-style consumer.

Starts the local Tansu broker (``LocalServices``, broker only, in a temporary folder that is
removed afterwards), creates a fresh topic set per shape with ``TopicNames`` /
``admin.ensure_topics`` and pushes realistic ``ExperienceGroup`` messages (random token
ids, log-probs and masks) through the real client code path:

- producer: ``kafka.data_producer`` (acks=all, as configured for the explorer) of each
  ``--producer`` library, ``aiokafka`` and/or ``confluent`` (librdkafka, ``kafka.producer:
  confluent``; needs the ``kafka-fast`` extra); per explorer step, ``groups_per_step``
  groups go through the explorer's own path, ``produce.send_groups`` (encode each with
  ``EXPERIENCE_GROUP.encode``, send, send what lingers, gather the step's acks);
- consumer: ``kafka.experience_consumer`` in a fresh group, polling with ``getmany`` and
  decoding every record with ``EXPERIENCE_GROUP.decode(value, headers)`` (header check,
  typed decode and ``validate_group``), until every group id has arrived.

Producer and consumer run concurrently on one asyncio loop in this process. The consumer
starts, joins its group and gets its partitions *before* the clock starts (the broker's
first join takes about half the session timeout; that is reported as ``join_s``, untimed).

Figures (MB = MiB = 2**20 bytes of encoded message values, the msgpack payload; keys,
headers and Kafka framing are not counted):

- ``seconds``: from the first ``encode``/``send`` to the last record decoded;
- ``mb_s`` = payload MB / ``seconds``; ``experiences_s`` = rollouts / ``seconds``;
- ``produce_s`` / ``produce_mb_s``: first send to the last step's acks gathered;
- ``loopback_mb_s``: the same encoded bytes sent as length-prefixed frames over a raw
  asyncio TCP connection on 127.0.0.1, from connect until the server has read every
  frame (median of 3 runs; same process, same loop);
- ``ratio_vs_loopback`` = ``mb_s`` / ``loopback_mb_s``.

The overall figures sum bytes, experiences and seconds over the shapes, per producer. Each
producer gets fresh topics; the loopback is measured once per shape and shared. In the
JSON line, ``by_producer`` holds each producer's overall figures and shapes;
``producer`` / ``ratio_vs_loopback`` / ``mb_s`` at the top are those of the fastest
producer run (the only one with a single ``--producer``). A figure, not a test: nothing is
asserted beyond every group arriving intact.

Usage: ``python bench/experience_path.py [--mb 64] [--quick] [--producer both]``.
Human-readable lines first, then one JSON line on stdout.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from streamrft.infra import admin, kafka, produce_confluent
from streamrft.infra.config import KafkaConfig
from streamrft.infra.local.services import LocalServices
from streamrft.infra.produce import send_groups
from streamrft.schemas import (
    EXPERIENCE_GROUP,
    Experience,
    ExperienceGroup,
    TopicNames,
    make_group_id,
    pack_f32,
    pack_i32,
    pack_u8,
)

MIB = 1 << 20
VOCAB = 151_936  # a Qwen-sized vocabulary
LOOPBACK_REPEATS = 3


@dataclass(frozen=True)
class Shape:
    name: str
    rollouts: int
    """Experiences per group (repeat_times)."""
    tokens: int
    """Prompt + response tokens per experience."""
    prompt: int
    """Prompt tokens per experience."""
    groups_per_step: int
    """Groups an explorer step sends before gathering the acks."""


SHAPES = (
    Shape("g8x1024", rollouts=8, tokens=1024, prompt=256, groups_per_step=8),
    Shape("g8x4096", rollouts=8, tokens=4096, prompt=512, groups_per_step=8),
)


def say(msg: str) -> None:
    print(msg, flush=True)


def make_group(
    rng: np.random.Generator, shape: Shape, run: str, index: int, version: int
) -> ExperienceGroup:
    task_id = f"task-{index:07d}"
    gid = make_group_id(run, task_id, 0)
    prompt = rng.integers(0, VOCAB, shape.prompt, dtype=np.int32)
    n_resp = shape.tokens - shape.prompt
    exps = []
    for i in range(shape.rollouts):
        response = rng.integers(0, VOCAB, n_resp, dtype=np.int32)
        logprobs = -rng.exponential(1.5, n_resp).astype(np.float32)
        mask = np.ones(n_resp, dtype=np.uint8)
        mask[rng.integers(n_resp // 2, n_resp) :] = 0  # padding / truncated tail
        exps.append(
            Experience(
                id=f"{gid}#{i}",
                # little-endian int32 / float32 / uint8: the bytes pack_i32/pack_f32/pack_u8 give
                tokens=np.concatenate([prompt, response]).astype("<i4").tobytes(),
                prompt_length=shape.prompt,
                logprobs=logprobs.astype("<f4").tobytes(),
                action_mask=mask.tobytes(),
                reward=float(rng.integers(0, 2)),
                model_version=version,
                info={"response_length": float(n_resp)},
            )
        )
    return ExperienceGroup(
        id=gid,
        run=run,
        task_id=task_id,
        explorer="explorer-0",
        model_version=version,
        experiences=exps,
        created_at=time.time(),
    )


def build_groups(shape: Shape, run: str, target_bytes: int, seed: int) -> list[ExperienceGroup]:
    """Distinct groups until their encoded size reaches ``target_bytes`` (whole steps)."""
    rng = np.random.default_rng(seed)
    first = make_group(rng, shape, run, 0, version=3)
    exp = first.experiences[0]
    # the numpy shortcut must produce exactly the codec helpers' bytes
    assert exp.tokens == pack_i32(np.frombuffer(exp.tokens, "<i4").tolist())
    assert exp.logprobs == pack_f32(np.frombuffer(exp.logprobs, "<f4").tolist())
    assert exp.action_mask == pack_u8(exp.action_mask)
    per_group = len(EXPERIENCE_GROUP.encode(first))
    n = max(1, -(-target_bytes // per_group))
    n = -(-n // shape.groups_per_step) * shape.groups_per_step
    return [first] + [make_group(rng, shape, run, i, version=3) for i in range(1, n)]


# --------------------------------------------------------------------------- loopback


async def loopback_once(payloads: list[bytes]) -> float:
    """Seconds to move ``payloads`` as length-prefixed frames over 127.0.0.1 TCP."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    expected = len(payloads)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nbytes = 0
        try:
            for _ in range(expected):
                (n,) = struct.unpack("<I", await reader.readexactly(4))
                nbytes += len(await reader.readexactly(n))
            if not done.done():
                done.set_result(nbytes)
        except Exception as exc:
            if not done.done():
                done.set_exception(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=1 << 20)
    port = server.sockets[0].getsockname()[1]
    try:
        t0 = time.perf_counter()
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for p in payloads:
                writer.write(struct.pack("<I", len(p)))
                writer.write(p)
                await writer.drain()
            received = await asyncio.wait_for(done, 120)
            elapsed = time.perf_counter() - t0
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        if received != sum(len(p) for p in payloads):
            raise RuntimeError(f"loopback received {received} bytes, expected more")
        return elapsed
    finally:
        server.close()
        await server.wait_closed()


# --------------------------------------------------------------------------- kafka path


async def kafka_once(
    cfg: KafkaConfig,
    shape: Shape,
    groups: list[ExperienceGroup],
    sent_bytes: int,
    run: str,
    timeout_s: float,
) -> dict[str, float]:
    topics = TopicNames(cfg.topic_prefix, run)
    await admin.ensure_topics(cfg, topics)
    consumer = kafka.experience_consumer(cfg, topics.experiences, f"{run}-trainer", "bench-trainer")
    producer = kafka.data_producer(cfg, "bench-explorer")
    started: list[object] = []
    try:
        t_join = time.perf_counter()  # aiokafka's start() already joins the group
        await kafka.start_client(consumer, "bench consumer")
        started.append(consumer)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not consumer.assignment():
            if loop.time() > deadline:
                raise RuntimeError("consumer got no partitions within 60 s")
            stray = await consumer.getmany(timeout_ms=100)
            if any(stray.values()):
                raise RuntimeError("fresh topic is not empty")
        join_s = time.perf_counter() - t_join
        await kafka.start_client(producer, "bench producer")
        started.append(producer)

        want = {g.id for g in groups}
        stats = {"bytes": 0, "experiences": 0, "duplicates": 0, "tokens": 0}

        async def consume() -> float:
            seen: set[str] = set()
            while len(seen) < len(want):
                batches = await consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for rec in records:
                        group = EXPERIENCE_GROUP.decode(rec.value, rec.headers)
                        if group.id in seen:
                            stats["duplicates"] += 1
                            continue
                        if group.id not in want:
                            raise RuntimeError(f"unexpected group {group.id!r}")
                        seen.add(group.id)
                        stats["bytes"] += len(rec.value)
                        stats["experiences"] += len(group.experiences)
                        stats["tokens"] += sum(e.num_tokens for e in group.experiences)
            return time.perf_counter()

        t0 = time.perf_counter()
        consumer_task = asyncio.create_task(consume())
        try:
            step = shape.groups_per_step
            for i in range(0, len(groups), step):
                await send_groups(producer, topics.experiences, groups[i : i + step], "bench", 30)
            t_produced = time.perf_counter()
            t_end = await asyncio.wait_for(consumer_task, timeout_s)
        finally:
            if not consumer_task.done():
                consumer_task.cancel()
                try:
                    await consumer_task
                except (asyncio.CancelledError, Exception):
                    pass
        if stats["bytes"] != sent_bytes:
            raise RuntimeError(f"consumed {stats['bytes']} payload bytes, sent {sent_bytes}")
        return {
            "seconds": t_end - t0,
            "produce_s": t_produced - t0,
            "join_s": join_s,
            "bytes": float(sent_bytes),
            "groups": float(len(groups)),
            "experiences": float(stats["experiences"]),
            "tokens": float(stats["tokens"]),
            "duplicates": float(stats["duplicates"]),
        }
    finally:
        for client in reversed(started):
            try:
                await client.stop()  # type: ignore[attr-defined]
            except Exception as exc:
                print(f"warning: stopping a Kafka client: {exc!r}", file=sys.stderr)


# --------------------------------------------------------------------------- main


async def run_shape(
    cfg: KafkaConfig, shape: Shape, mb: float, tag: str, seed: int, producers: list[str]
) -> dict[str, dict]:
    """The shape through each producer: ``{producer: figures}``."""
    run = f"bench-{tag}-{shape.name}"
    t = time.perf_counter()
    groups = build_groups(shape, run, int(mb * MIB), seed)
    payloads = [EXPERIENCE_GROUP.encode(g) for g in groups]
    total = sum(len(p) for p in payloads)
    n_exp = sum(len(g.experiences) for g in groups)
    say(
        f"[{shape.name}] {len(groups)} groups x {shape.rollouts} rollouts x {shape.tokens} tokens"
        f" = {n_exp} experiences, {total / MIB:.1f} MB payload"
        f" ({total / len(groups) / 1024:.0f} KiB/group), built in {time.perf_counter() - t:.1f} s"
    )

    loop_times = [await loopback_once(payloads) for _ in range(LOOPBACK_REPEATS)]
    loop_s = statistics.median(loop_times)
    del payloads
    say(
        f"[{shape.name}] loopback TCP: {total / MIB / loop_s:.0f} MB/s"
        f" (median of {LOOPBACK_REPEATS}: {', '.join(f'{x:.3f}' for x in loop_times)} s)"
    )

    out = {}
    for name in producers:
        pcfg = msgspec.structs.replace(cfg, producer=name)
        r = await kafka_once(pcfg, shape, groups, total, f"{run}-{name}", max(120.0, mb * 4))
        out[name] = shape_figures(shape, r, loop_s, name)
    return out


def shape_figures(shape: Shape, r: dict[str, float], loop_s: float, producer: str) -> dict:
    mb_total = r["bytes"] / MIB
    res = {
        "groups": int(r["groups"]),
        "experiences": int(r["experiences"]),
        "tokens": int(r["tokens"]),
        "mb": round(mb_total, 2),
        "seconds": round(r["seconds"], 3),
        "mb_s": round(mb_total / r["seconds"], 1),
        "experiences_s": round(r["experiences"] / r["seconds"], 1),
        "produce_s": round(r["produce_s"], 3),
        "produce_mb_s": round(mb_total / r["produce_s"], 1),
        "join_s": round(r["join_s"], 2),
        "duplicates": int(r["duplicates"]),
        "loopback_s": round(loop_s, 4),
        "loopback_mb_s": round(mb_total / loop_s, 1),
        "ratio_vs_loopback": round(loop_s / r["seconds"], 4),
    }
    say(
        f"[{shape.name}] {producer}: kafka end to end: {res['mb_s']} MB/s,"
        f" {res['experiences_s']} experiences/s ({res['seconds']} s; produce+acks"
        f" {res['produce_s']} s = {res['produce_mb_s']} MB/s; group join {res['join_s']} s"
        f" untimed; duplicates {res['duplicates']}); ratio vs loopback:"
        f" {res['ratio_vs_loopback']}"
    )
    return res


def overall(shapes: dict[str, dict]) -> dict:
    """One producer's figures summed over the shapes."""
    mb_total = sum(s["mb"] for s in shapes.values())
    secs = sum(s["seconds"] for s in shapes.values())
    produce_s = sum(s["produce_s"] for s in shapes.values())
    loop_s = sum(s["loopback_s"] for s in shapes.values())
    exps = sum(s["experiences"] for s in shapes.values())
    return {
        "mb_s": round(mb_total / secs, 1),
        "experiences_s": round(exps / secs, 1),
        "produce_mb_s": round(mb_total / produce_s, 1),
        "loopback_mb_s": round(mb_total / loop_s, 1),
        "ratio_vs_loopback": round(loop_s / secs, 4),
        "mb": round(mb_total, 2),
        "seconds": round(secs, 3),
        "shapes": shapes,
    }


async def run_all(bootstrap: str, mb: float, seed: int, producers: list[str]) -> dict:
    cfg = KafkaConfig(bootstrap_servers=bootstrap)
    tag = time.strftime("%Y%m%d-%H%M%S")
    per_shape = {}
    for i, shape in enumerate(SHAPES):
        per_shape[shape.name] = await run_shape(cfg, shape, mb, tag, seed + i, producers)
    by_producer = {
        name: overall({shape: figures[name] for shape, figures in per_shape.items()})
        for name in producers
    }
    best = max(producers, key=lambda name: by_producer[name]["ratio_vs_loopback"])
    top = by_producer[best]
    return {
        "bench": "experience_path",
        "producer": best,
        "ratio_vs_loopback": top["ratio_vs_loopback"],
        "mb_s": top["mb_s"],
        "experiences_s": top["experiences_s"],
        "loopback_mb_s": top["loopback_mb_s"],
        "mb": top["mb"],
        "seconds": top["seconds"],
        "by_producer": by_producer,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=None, help="payload MiB per shape (default 64)")
    ap.add_argument("--quick", action="store_true", help="tiny run (2 MiB per shape)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--producer",
        choices=("aiokafka", "confluent", "both"),
        default="both" if produce_confluent.available() else "aiokafka",
        help="data producer library (kafka.producer); default: both when confluent-kafka"
        " is installed, else aiokafka",
    )
    args = ap.parse_args(argv)
    producers = ["aiokafka", "confluent"] if args.producer == "both" else [args.producer]
    if "confluent" in producers and not produce_confluent.available():
        ap.error("--producer confluent needs confluent-kafka (pip install 'streamrft[kafka-fast]')")
    mb = args.mb if args.mb is not None else (2.0 if args.quick else 64.0)
    if mb <= 0:
        ap.error("--mb must be > 0")

    # SIGTERM -> SystemExit so that the finally block below stops the services
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="streamrft-bench-exp-"))
    services = LocalServices(tmp, broker=True, object_store=False)
    try:
        eps = services.start()
        say(f"broker at {eps.bootstrap_servers} (Tansu, memory storage), {mb:g} MB per shape")
        result = asyncio.run(run_all(eps.bootstrap_servers or "", mb, args.seed, producers))
    finally:
        services.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for name, r in result["by_producer"].items():
        say(
            f"overall {name}: {r['mb_s']} MB/s, {r['experiences_s']} experiences/s,"
            f" produce {r['produce_mb_s']} MB/s, loopback {r['loopback_mb_s']} MB/s,"
            f" ratio {r['ratio_vs_loopback']}"
        )
    say(f"wall {time.perf_counter() - t_start:.1f} s")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
