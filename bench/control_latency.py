"""Benchmark: latency of a ``ModelVersionReady`` from the trainer's send to an explorer's reaction.

Starts the local Tansu broker (``LocalServices``, broker only, memory storage, in a
temporary folder removed afterwards). For each control fetch wait
(``kafka.control_fetch_max_wait_ms``, the long-poll wait of every control/status reader,
``kafka.event_reader``), on a fresh run's topics (``admin.ensure_topics``):

- an **explorer** process (a child running this file with ``--explorer``: its own
  interpreter and event loop; JSON lines on its stdin/stdout) holds a
  :class:`ControlView` as the explorer does (control and status topics) and waits for
  each version in turn exactly as the ``WeightFollower`` does,
  ``view.wait_until(lambda: v in view.versions, ...)``; the moment that returns is the
  reaction, stamped with ``time.monotonic_ns()`` (CLOCK_MONOTONIC: one clock for every
  process of the machine);
- this process is the **trainer**: an :class:`EventSender` (acks=all, ``linger_ms=0``,
  the path ``VersionPublisher`` announces through) sends ``--events`` announcements at a
  steady pace (``--interval-ms``), each stamped just before ``EventSender.control``.

Figures per fetch wait: ``p50_ms`` / ``p99_ms`` / ``max_ms`` of reaction - send;
``ack_p50_ms``: the send's own acks=all round trip; idle load: CPU % of the explorer's
reader process and of the broker over ``--idle-s`` seconds with the view started and no
event sent (what a long poll that short costs while nothing happens). The final JSON line
carries the configured default's figures at the top, every wait under ``waits``.

Usage: ``python bench/control_latency.py [--events 200] [--interval-ms 50]
[--fetch-wait 20,5,100] [--quick]``. A noisy machine moves the tail (p99, max) most.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from streamrft.infra import admin
from streamrft.infra.bus import ControlView, EventSender
from streamrft.infra.config import Config, KafkaConfig, RunSection
from streamrft.infra.local.services import LocalServices
from streamrft.schemas.errors import SyncTimeout
from streamrft.schemas.events import ModelVersionReady

DEFAULT_WAIT_MS = KafkaConfig().control_fetch_max_wait_ms
TICK = os.sysconf("SC_CLK_TCK")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_cfg(bootstrap: str, run_id: str, wait_ms: int) -> Config:
    return Config(
        run=RunSection(id=run_id),
        kafka=KafkaConfig(bootstrap_servers=bootstrap, control_fetch_max_wait_ms=wait_ms),
    )


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# -- the explorer side (a child process: ``control_latency.py --explorer ...``) -------------
# It talks to the trainer side in JSON lines on its stdin/stdout (nothing pickled).


def explorer_main(bootstrap: str, run_id: str, wait_ms: int, events: int) -> None:
    asyncio.run(_explorer(make_cfg(bootstrap, run_id, wait_ms), events))


def tell(obj: object) -> None:
    print(json.dumps(obj), flush=True)


async def _explorer(cfg: Config, events: int) -> None:
    async def dead_letter(_rec) -> None:
        raise AssertionError("the bench sends only well-formed events")

    view = ControlView(cfg, "explorer-0", dead_letter, listen_status=True)
    await view.start()
    stop = asyncio.Event()
    try:
        tell("ready")
        # the idle window: the trainer side measures, then says "go"
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        tell("waiting")
        reacted: list[int] = []
        try:
            for v in range(events):
                await view.wait_until(lambda v=v: v in view.versions, 30.0, stop, f"version {v}")
                reacted.append(time.monotonic_ns())
        except SyncTimeout as exc:  # reported, and the next fetch wait is benched
            tell(f"{type(exc).__name__}: {exc}")
            return
        tell(reacted)
    finally:
        await view.stop()


# -- the trainer side ----------------------------------------------------------------------


async def one_wait(bootstrap: str, broker_pid: int, wait_ms: int, args: argparse.Namespace) -> dict:
    run_id = f"latency-{wait_ms}ms-{time.strftime('%H%M%S')}-{os.getpid()}"
    cfg = make_cfg(bootstrap, run_id, wait_ms)
    await admin.ensure_topics(cfg.kafka, cfg.topics())
    argv = [__file__, "--explorer", bootstrap, run_id, str(wait_ms), str(args.events)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    sender = EventSender(cfg, "trainer", "trainer")
    await sender.start()
    try:
        assert await receive(proc, 60) == "ready"
        await asyncio.sleep(1.0)  # the reader's first fetches settle
        idle = await idle_load(proc.pid, broker_pid, args.idle_s)
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        assert await receive(proc, 30) == "waiting"
        await asyncio.sleep(0.2)
        sent, acks = await send_steadily(sender, args.events, args.interval_ms / 1000)
        reacted = await receive(proc, 120)
    finally:
        await sender.stop()
        if proc.returncode is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 30)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if isinstance(reacted, str):  # the explorer saw no event (a fetch wait that fails)
        say(f"[fetch wait {wait_ms} ms] FAILED: {reacted}")
        return {"fetch_wait_ms": wait_ms, "error": reacted, **idle}
    lat = sorted((r - s) / 1e6 for s, r in zip(sent, reacted, strict=True))
    res = {
        "fetch_wait_ms": wait_ms,
        "events": args.events,
        "interval_ms": args.interval_ms,
        "p50_ms": round(statistics.median(lat), 2),
        "p90_ms": round(quantile(lat, 0.90), 2),
        "p99_ms": round(quantile(lat, 0.99), 2),
        "max_ms": round(lat[-1], 2),
        "min_ms": round(lat[0], 2),
        "mean_ms": round(statistics.fmean(lat), 2),
        "ack_p50_ms": round(statistics.median(acks), 2),
        "ack_p99_ms": round(quantile(sorted(acks), 0.99), 2),
        **idle,
    }
    say(
        f"[fetch wait {wait_ms} ms] reaction p50 {res['p50_ms']} ms, p99 {res['p99_ms']} ms,"
        f" max {res['max_ms']} ms (send ack p50 {res['ack_p50_ms']} ms); idle CPU: explorer"
        f" reader {res['idle_reader_cpu_pct']} %, broker {res['idle_broker_cpu_pct']} %"
    )
    return res


async def receive(proc: asyncio.subprocess.Process, timeout_s: float) -> object:
    """The explorer's next JSON line; EOFError if it died, TimeoutError if it hangs."""
    line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    if not line:
        raise EOFError(f"the explorer process ended (exit code {await proc.wait()})")
    return json.loads(line)


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``xs`` (nearest rank)."""
    return xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


async def idle_load(reader_pid: int, broker_pid: int, seconds: float) -> dict:
    r0, b0, t0 = cpu_s(reader_pid), cpu_s(broker_pid), time.monotonic()
    await asyncio.sleep(seconds)
    r1, b1, t1 = cpu_s(reader_pid), cpu_s(broker_pid), time.monotonic()
    return {
        "idle_s": round(t1 - t0, 2),
        "idle_reader_cpu_pct": round(100 * (r1 - r0) / (t1 - t0), 1),
        "idle_broker_cpu_pct": round(100 * (b1 - b0) / (t1 - t0), 1),
    }


async def send_steadily(
    sender: EventSender, events: int, interval_s: float
) -> tuple[list[int], list[float]]:
    """Announce versions 0..events-1, one every ``interval_s``; (send stamps, ack ms)."""
    sent: list[int] = []
    acks: list[float] = []
    start = time.monotonic()
    for v in range(events):
        delay = start + v * interval_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        event = ModelVersionReady(
            version=v,
            method="object_store",
            uri=f"s3://bench/latency/v{v:06d}/manifest.json",
            manifest_sha256="0" * 64,
            bytes=1 << 20,
            step=v,
            created_at=time.time(),
        )
        t = time.monotonic_ns()
        sent.append(t)
        await sender.control(event)
        acks.append((time.monotonic_ns() - t) / 1e6)
    return sent, acks


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--explorer"]:  # the child side
        bootstrap, run_id, wait_ms, events = sys.argv[2:6]
        explorer_main(bootstrap, run_id, int(wait_ms), int(events))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=None, help="announcements (default 200)")
    ap.add_argument("--interval-ms", type=float, default=50.0, help="pace of the sends")
    ap.add_argument(
        "--fetch-wait",
        default=None,
        help=f"comma list of control fetch waits in ms (default {DEFAULT_WAIT_MS},5,100)",
    )
    ap.add_argument("--idle-s", type=float, default=None, help="idle-load window (default 5)")
    ap.add_argument("--quick", action="store_true", help="50 events, the default wait only")
    args = ap.parse_args(argv)
    args.events = args.events or (50 if args.quick else 200)
    args.idle_s = args.idle_s or (2.0 if args.quick else 5.0)
    waits_arg = args.fetch_wait or (
        str(DEFAULT_WAIT_MS) if args.quick else f"{DEFAULT_WAIT_MS},5,100"
    )
    waits = [int(w) for w in waits_arg.split(",")]

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="streamrft-bench-latency-"))
    services = LocalServices(tmp, broker=True, object_store=False)
    try:
        eps = services.start()
        broker_pid = services._service("broker").popen.pid  # the Tansu process
        say(f"broker at {eps.bootstrap_servers} (Tansu, memory storage), pid {broker_pid}")

        async def run_all() -> list[dict]:
            return [await one_wait(eps.bootstrap_servers or "", broker_pid, w, args) for w in waits]

        results = asyncio.run(run_all())
    finally:
        services.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    done = [r for r in results if "error" not in r] or results
    head = next((r for r in done if r["fetch_wait_ms"] == DEFAULT_WAIT_MS), done[0])
    say(f"wall {time.perf_counter() - t_start:.1f} s")
    line = {
        "bench": "control_latency",
        "p50_ms": head.get("p50_ms"),
        "p99_ms": head.get("p99_ms"),
        "max_ms": head.get("max_ms"),
        "fetch_wait_ms": head["fetch_wait_ms"],
        "default_fetch_wait_ms": DEFAULT_WAIT_MS,
        "events": args.events,
        "interval_ms": args.interval_ms,
        "waits": results,
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
