"""Benchmark: serve mode's requests/s and latency against calling the engine directly.

Starts the local Tansu broker (``LocalServices``, broker only, in a temporary folder) and a
real ``streamrft serve`` process on the default example's tiny model (``serve.serve_initial``:
it serves the configured weights as version 0, no trainer needed), then in this process:

- serve: ``--clients`` threads send ``--requests`` chat completions in all (the prompts of
  ``examples/data/addition.jsonl`` in turn, ``max_tokens`` ``--max-tokens``, temperature 1,
  ``n`` 1) over HTTP with the official ``openai`` client, one client per thread; each
  request's latency is from send to parsed response. Every response is recorded by the
  server, as in production (nothing is committed);
- direct: the same model (same config, same seed, so the same weights), loaded here with
  the same engine (``TransformersEngine``), one ``engine.rollout`` call per request, the
  same prompts rendered by the same renderer, one after the other — what an application
  calling the model itself would do with one request at a time.

``rps`` is serve's requests over its wall time; ``direct_rps`` the direct calls' over
theirs; ``ratio_vs_direct`` = ``rps`` / ``direct_rps`` (above 1: serve's batching of
concurrent requests outweighs its HTTP and recording overhead; with ``--clients 1`` it is
serve's overhead alone). ``p50_ms`` / ``p99_ms``: serve's latency percentiles;
``direct_p50_ms`` the direct call's. ``direct_batched_rps``: the same prompts in direct
calls of ``--clients`` prompts each (the best the batching can reach), for context.

Usage: ``python bench/serve.py [--clients 8] [--requests 400] [--max-tokens 4]``. Progress
on stderr; one JSON line on stdout. One torch thread in each process.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch

from streamrft.infra.config import load_config
from streamrft.infra.local.services import LocalServices
from streamrft.infra.modeling import load_policy
from streamrft.infra.prompts import PromptRenderer
from streamrft.infra.taskset import read_taskset
from streamrft.producers.engines import TransformersEngine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic.yaml"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_server(folder: Path, bootstrap: str, run_id: str) -> tuple[subprocess.Popen, str]:
    argv = [
        sys.executable, "-m", "streamrft.app.cli", "serve", str(EXAMPLE),
        "--run-id", run_id, "--port", "0",
        "-o", f"run.dir={folder}", "-o", f"kafka.bootstrap_servers={bootstrap}",
        "-o", "object_store.endpoint=http://127.0.0.1:1", "-o", "serve.serve_initial=true",
        "-o", "serve.max_recorded=1000000",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = (folder / "serve.log").open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    announce = folder / run_id / "serve"
    deadline = time.monotonic() + 180
    while not (announce.is_dir() and any(announce.glob("*.json"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start: {(folder / 'serve.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, json.loads(next(announce.glob("*.json")).read_text())["url"]


def bench_serve(url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    def one(i: int, client: openai.OpenAI) -> float:
        t0 = time.perf_counter()
        client.chat.completions.create(
            model="", messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=max_tokens, temperature=1.0,
        )  # fmt: skip
        return time.perf_counter() - t0

    pool_clients = [
        openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) for _ in range(clients)
    ]
    for c in pool_clients:  # connections open, the server warm
        one(0, c)
    n = len(prompts)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = list(pool.map(lambda i: one(i, pool_clients[i % clients]), range(n)))
    wall = time.perf_counter() - t0
    return {"rps": n / wall, "latencies": latencies}


def bench_direct(prompts_ids: list[list[int]], engine, max_tokens: int, batch: int) -> dict:
    engine.rollout(prompts_ids[:1], 1, 1.0, max_tokens, 0)  # warm
    latencies = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts_ids), batch):
        t1 = time.perf_counter()
        engine.rollout(prompts_ids[i : i + batch], 1, 1.0, max_tokens, i)
        latencies.append(time.perf_counter() - t1)
    return {"rps": len(prompts_ids) / (time.perf_counter() - t0), "latencies": latencies}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(EXAMPLE)
    tasks = read_taskset(cfg.taskset.path, cfg.taskset)
    texts = [tasks[i % len(tasks)].prompt for i in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        folder = Path(tmp)
        with LocalServices(folder / "services", object_store=False) as services:
            proc, url = start_server(folder, services.endpoints.bootstrap_servers, "bench-serve")
            try:
                say(f"serve at {url}: {args.requests} requests from {args.clients} clients")
                served = bench_serve(url, texts, args.clients, args.max_tokens)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    model, tokenizer = load_policy(cfg.model, dtype=torch.float32)
    engine = TransformersEngine(model.eval(), tokenizer)
    renderer = PromptRenderer.from_config(cfg.taskset, tokenizer)
    ids = [renderer.ids(tasks[i % len(tasks)]) for i in range(args.requests)]
    say("direct: one engine call per request, then batches of --clients")
    direct = bench_direct(ids, engine, args.max_tokens, 1)
    batched = bench_direct(ids, engine, args.max_tokens, args.clients)
    lat = [x * 1000 for x in served["latencies"]]
    result = {
        "bench": "serve",
        "clients": args.clients,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rps": round(served["rps"], 1),
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(percentile(lat, 0.99), 2),
        "direct_rps": round(direct["rps"], 1),
        "direct_p50_ms": round(statistics.median(direct["latencies"]) * 1000, 2),
        "direct_batched_rps": round(batched["rps"], 1),
        "ratio_vs_direct": round(served["rps"] / direct["rps"], 3),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
