"""Benchmark: bytes a version moves to explorers as a delta vs whole, on real training steps.

For each case, a float32 master model (what the trainer holds) is wrapped in the trainer's
:class:`~streamrft.sync.payload.ModelWeights` with ``synchronizer.delta: auto``
(``DeltaPolicy(always=False, full_every=10, max_ratio=0.5)``) and the explorers' dtype:

- ``tiny_fp32``: the tiny model of ``examples/arithmetic.yaml`` sent in float32;
- ``tiny_bf16``: the same model sent in bfloat16;
- ``smollm2_bf16``: SmolLM2-135M-Instruct (``models/smollm2-135m-instruct``, made by
  ``streamrft models prepare smollm2``; skipped, and said so, when absent) sent in
  bfloat16.

Version 0 is published whole. Then ``--steps`` times: one real optimizer step (AdamW with
the trainer's defaults, ``betas`` (0.9, 0.999), grad clip 1.0, at the case's ``lr``: the
example's 3e-4 for the tiny model, ``--smollm2-lr`` (default 1e-6, a usual full fine-tuning
rate) for SmolLM2; the loss is next-token cross-entropy on prompt + answer of 8 tasks of the
example's taskset, so every parameter gets a gradient), then ``ModelWeights.payload`` makes
the next version (``payload_s``: cast, bitwise compare with the last version, encode, sha256
of the whole state) and both forms go through the ``filesystem`` store into a fresh
temporary folder (the same publish/fetch code as the object store; its bytes are what an
explorer downloads):

- ``full_bytes``: shard bytes of the version published whole (``publish_full_s``,
  ``fetch_full_s``: fetch + verify);
- ``delta_bytes``: shard bytes of the delta (``encode`` of the same state against the last
  version), ``publish_delta_s``; ``fetch_rebuild_s``: fetch + verify the delta, rebuild on
  the previous state (``delta.decode``) and check the rebuilt state's sha256;
- ``sent``: what ``auto`` sent (``delta`` or ``full``); ``bytes_ratio``: the bytes that
  moved / ``full_bytes`` (1.0 when it fell back to full); ``delta_ratio``: ``delta_bytes``
  / ``full_bytes`` whatever was sent; ``changed``: the share of elements whose bits changed.

Every rebuilt delta is checked bit for bit against the state published whole (raises if
not). Figures are per step, the last step's at the top of each case. Timings on a shared
2-core machine are noisy; the bytes are exact.

Usage: ``python bench/delta_sync.py [--steps 2] [--smollm2 DIR] [--smollm2-lr 1e-6]
[--cases tiny_fp32,tiny_bf16,smollm2_bf16]``. Last line: one JSON object
``{"bench": "delta_sync", "bytes_ratio": <smollm2_bf16's, else tiny_bf16's>, ...,
"cases": {...}}``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamrft.sync import delta
from streamrft.sync.filesystem import FilesystemLoader, FilesystemPublisher
from streamrft.sync.payload import DeltaPolicy, ModelWeights

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic.yaml"
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
WORDS = ROOT / "examples" / "data" / "wordproblems_small.jsonl"
TASKS = 8
SHARD = 64 << 20


def say(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    texts: list[str]
    tokenize: Any
    dtype: torch.dtype
    lr: float


def tiny_case(name: str, dtype: torch.dtype) -> Case:
    from streamrft.infra.config import load_config
    from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model

    cfg = load_config(EXAMPLE, needs_secrets=False)
    tok = build_char_tokenizer(cfg.model.charset)
    lines = (ROOT / "examples" / "data" / "addition.jsonl").read_text().splitlines()[:TASKS]
    texts = [json.loads(line)["prompt"] + json.loads(line)["answer"] for line in lines]
    model = build_tiny_model(cfg.model, tok).float()
    return Case(name, model, texts, lambda t: tok.encode(t), dtype, cfg.trainer.lr)


def smollm2_case(folder: Path, lr: float) -> Case:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
    lines = WORDS.read_text().splitlines()[:TASKS]
    texts = [
        json.loads(line)["messages"][0]["content"] + " <answer>" + json.loads(line)["answer"]
        for line in lines
    ]
    return Case("smollm2_bf16", model, texts, lambda t: tok(t)["input_ids"], torch.bfloat16, lr)


def train_step(case: Case, opt: torch.optim.Optimizer) -> float:
    """One optimizer step of next-token loss over the case's texts; seconds."""
    t0 = time.perf_counter()
    opt.zero_grad()
    for text in case.texts:
        ids = torch.tensor([case.tokenize(text)])
        (case.model(input_ids=ids, labels=ids).loss / len(case.texts)).backward()
    torch.nn.utils.clip_grad_norm_(case.model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t0


def as_sent(case: Case, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors named in ``like``, in the explorers' dtype."""
    own = case.model.state_dict()
    return {k: own[k].detach().to(case.dtype).contiguous() for k in like}


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(delta.bits(a[k]), delta.bits(b[k])) for k in a)


def changed_share(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    total = sum(t.numel() for t in new.values())
    changed = sum(int(torch.count_nonzero(delta.bits(new[k]).ne(delta.bits(old[k])))) for k in new)
    return changed / total


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def one_step(
    case: Case,
    weights: ModelWeights,
    opt: torch.optim.Optimizer,
    prev: dict[str, torch.Tensor],
    version: int,
    folder: Path,
) -> dict:
    """Train, make the version, publish and fetch it both ways; the step's figures."""
    train_s = train_step(case, opt)
    payload, payload_s = timed(weights.payload, version, version)
    sent = "delta" if weights.sent and weights.sent.delta_base >= 0 else "full"
    state = as_sent(case, prev)
    changes, encode_s = timed(delta.encode, state, prev)
    full_pub = FilesystemPublisher(folder / "full", "bench", SHARD)
    delta_pub = FilesystemPublisher(folder / "delta", "bench", SHARD)
    full_ev, publish_full_s = timed(full_pub.publish, state, version, version)
    delta_ev, publish_delta_s = timed(delta_pub.publish, changes, version, version)
    fetched, fetch_full_s = timed(FilesystemLoader(folder / "full").fetch, full_ev)

    def fetch_rebuild() -> dict:
        got = FilesystemLoader(folder / "delta").fetch(delta_ev)
        rebuilt = delta.decode(got, prev)
        delta.verify_state(rebuilt, delta.state_sha256(state), f"version {version}")
        return rebuilt

    rebuilt, fetch_rebuild_s = timed(fetch_rebuild)
    if not (bits_equal(rebuilt, state) and bits_equal(fetched, state)):
        raise SystemExit(f"{case.name}: version {version} did not come back bit for bit")
    if sent == "delta" and not bits_equal(delta.decode(payload.tensors, prev), state):
        raise SystemExit(f"{case.name}: the payload's delta does not rebuild version {version}")
    moved = delta_ev.bytes if sent == "delta" else full_ev.bytes
    return {
        "version": version,
        "sent": sent,
        "full_bytes": full_ev.bytes,
        "delta_bytes": delta_ev.bytes,
        "bytes_ratio": round(moved / full_ev.bytes, 4),
        "delta_ratio": round(delta_ev.bytes / full_ev.bytes, 4),
        "changed": round(changed_share(state, prev), 4),
        "train_s": round(train_s, 3),
        "payload_s": round(payload_s, 3),
        "encode_s": round(encode_s, 3),
        "publish_full_s": round(publish_full_s, 3),
        "publish_delta_s": round(publish_delta_s, 3),
        "fetch_full_s": round(fetch_full_s, 3),
        "fetch_rebuild_s": round(fetch_rebuild_s, 3),
    }


def run_case(case: Case, steps: int) -> dict:
    policy = DeltaPolicy(always=False, full_every=10, max_ratio=0.5)
    weights = ModelWeights(case.model, False, case.dtype, delta=policy)
    opt = torch.optim.AdamW(case.model.parameters(), lr=case.lr)
    first = weights.payload(0, 0)
    prev = {k: v.clone() for k, v in first.tensors.items()}
    params = sum(t.numel() for t in prev.values())
    per_step = []
    with tempfile.TemporaryDirectory(prefix="delta-bench-") as tmp:
        for version in range(1, steps + 1):
            fig = one_step(case, weights, opt, prev, version, Path(tmp))
            per_step.append(fig)
            say(
                f"{case.name} v{version}: sent {fig['sent']}, {fig['delta_bytes']:,} of "
                f"{fig['full_bytes']:,} bytes as a delta ({fig['delta_ratio']:.3f}; "
                f"{fig['changed']:.2%} of elements changed), moved ratio {fig['bytes_ratio']}"
            )
            prev = {k: v.clone() for k, v in as_sent(case, prev).items()}
    return {
        **per_step[-1],
        "dtype": str(case.dtype).removeprefix("torch."),
        "params": params,
        "lr": case.lr,
        "steps": per_step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cases", default="tiny_fp32,tiny_bf16,smollm2_bf16")
    ap.add_argument("--smollm2", type=Path, default=SMOLLM2)
    ap.add_argument("--smollm2-lr", type=float, default=1e-6)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    wanted = args.cases.split(",")
    cases: dict[str, Any] = {}
    for name in wanted:
        if name == "tiny_fp32":
            case = tiny_case(name, torch.float32)
        elif name == "tiny_bf16":
            case = tiny_case(name, torch.bfloat16)
        elif name == "smollm2_bf16":
            if not (args.smollm2 / "config.json").is_file():
                say(f"smollm2_bf16: no model at {args.smollm2} (streamrft models prepare smollm2)")
                cases[name] = None
                continue
            case = smollm2_case(args.smollm2, args.smollm2_lr)
        else:
            raise SystemExit(f"--cases: unknown case {name!r}")
        cases[name] = run_case(case, args.steps)
    headline = cases.get("smollm2_bf16") or cases.get("tiny_bf16") or {}
    print(
        json.dumps(
            {
                "bench": "delta_sync",
                "bytes_ratio": headline.get("bytes_ratio"),
                "headline_case": "smollm2_bf16" if cases.get("smollm2_bf16") else "tiny_bf16",
                "tiny_fp32_bytes_ratio": (cases.get("tiny_fp32") or {}).get("bytes_ratio"),
                "tiny_bf16_bytes_ratio": (cases.get("tiny_bf16") or {}).get("bytes_ratio"),
                "smollm2_bf16_bytes_ratio": (cases.get("smollm2_bf16") or {}).get("bytes_ratio"),
                "cases": cases,
            }
        )
    )


if __name__ == "__main__":
    main()
