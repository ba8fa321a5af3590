"""Benchmark: rollout throughput of the engines against the libraries called directly.

For each model and engine, in one process and one run, the same prompts are sampled with
the same settings (temperature, top-k off, top-p 1, ``max_new_tokens``, ``n`` samples per
prompt, the whole batch in one call) two ways, alternated for ``--rounds`` rounds so that
load on the machine falls on both alike:

- **engine**: the explorer's path: ``math_workflow`` (render the tasks' prompts, one
  ``rollout`` call through :class:`SerialEngine`, score each response, build the
  experiences) around the engine ``explorer.engine`` names. ``rollout_s`` is the engine's
  call alone, ``workflow_s`` what the workflow adds around it (rendering, reward,
  experiences).
- **direct**, transformers: ``model.generate(do_sample=True, temperature, top_k=0,
  top_p=1.0, num_return_sequences=n, output_scores=True)`` on the same left-padded prompt
  ids, then the sampled tokens' log-probs from the scores (``log_softmax`` of the
  temperature-scaled logits, the engine's definition) — the engine records a log-prob per
  token, so the fair baseline computes them too. ``direct_nolp_tokens_s`` is the
  ``generate`` call alone (what a user who needs no log-probs would time).
- **direct**, vLLM: ``LLM.generate`` of the engine's own ``LLM`` (same weights, same KV
  cache) with the very ``SamplingParams`` the engine builds (per-prompt seeds,
  ``logprobs=0``, no detokenisation); ``direct_unseeded_tokens_s``: one ``SamplingParams``
  with no seed, what a user would write.

Tokens: response tokens up to and including the first EOS (``max_new_tokens`` when none),
counted the same way on both sides; ``tokens_s`` = tokens / seconds summed over rounds
(the warm-up round is untimed). ``ratio_vs_direct`` = engine tokens/s (the whole workflow)
/ direct tokens/s (with log-probs); ``framework_share`` = 1 - that ratio: the share of the
engine path's time the direct call would not spend. ``ratio_vs_direct_cpu``: the same
ratio over this process's CPU time (``time.process_time``) instead of wall time, which
other work on a shared machine moves far less; ``per_call_tokens_s`` shows the spread. The two transformers sides draw from different
random streams, so their responses end (EOS) at different places; both compute every row
up to the batch's longest response, and ``ratio_vs_direct_computed(_cpu)`` compares those
computed positions per second instead (vLLM's seeded sides sample the very same tokens).

Models: ``tiny`` (the example's Llama, two heads of 32 so vLLM's CPU attention takes it)
and ``smollm2`` (``models/smollm2-135m-instruct``, when that folder exists: ``streamrft
models prepare smollm2``). Engines: ``transformers`` always; ``vllm`` when ``vllm`` imports
(``.venv-vllm``), else skipped with the reason. Run it in either venv:

    OMP_NUM_THREADS=1 .venv/bin/python bench/rollout.py [--quick]
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/rollout.py

Human-readable lines on stderr, then one JSON line on stdout.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import argparse
import importlib.util
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import load_policy
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines.base import SerialEngine
from streamrft.producers.engines.transformers_engine import TransformersEngine
from streamrft.producers.rewards import get_reward
from streamrft.producers.tasksets import word_problems
from streamrft.producers.workflows import RolloutSpec
from streamrft.producers.workflows.math_workflow import math_workflow
from streamrft.schemas.experience import ChatMessage, Task

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Shape:
    """One model and the sampling settings it is benched with."""

    name: str
    model: ModelConfig
    tasks: int
    n: int
    max_new_tokens: int
    reward: str
    temperature: float = 1.0
    repeat: int = 1
    """Calls of each side per round (a small model's call is short: more of them)."""

    def make_tasks(self, seed: int) -> list[Task]:
        if self.model.source == "tiny":
            rng = random.Random(seed)
            pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(self.tasks)]
            return [
                Task(id=f"t{i}", prompt=f"{a}+{b}=", answer=str(a + b))
                for i, (a, b) in enumerate(pairs)
            ]
        lines = word_problems(self.tasks, seed)
        return [
            Task(
                id=line["id"],
                answer=line["answer"],
                messages=[ChatMessage(**m) for m in line["messages"]],
            )
            for line in lines
        ]


def shapes(args: argparse.Namespace) -> list[Shape]:
    quick = args.quick
    out = [
        Shape(
            "tiny",
            ModelConfig(num_heads=2, max_positions=64),
            tasks=8 if quick else 32,
            n=4 if quick else 8,
            max_new_tokens=16 if quick else 32,
            reward="exact_match",
            repeat=2 if quick else 5,
        )
    ]
    if "smollm2" in args.models:
        if (SMOLLM2 / "config.json").is_file():
            out.append(
                Shape(
                    "smollm2",
                    ModelConfig(source="path", path=str(SMOLLM2)),
                    tasks=2 if quick else 8,
                    n=2 if quick else 4,
                    max_new_tokens=16 if quick else 48,
                    reward="math_answer",
                )
            )
        else:
            say(f"smollm2: skipped, no model at {SMOLLM2} (streamrft models prepare smollm2)")
    return [s for s in out if s.name in args.models]


# -- timing --------------------------------------------------------------------------------


@dataclass
class Tally:
    """Seconds and tokens of one side, summed over the timed rounds."""

    seconds: float = 0.0
    tokens: int = 0
    parts: dict[str, float] | None = None
    per_call: list[float] | None = None
    """Tokens/s of each call, to judge the noise."""
    cpu_seconds: float = 0.0
    """CPU time of this process over the same calls (every thread, vLLM's engine core
    included: it runs in this process): what contention on a shared machine moves least."""

    def add(self, seconds: float, tokens: int, cpu: float = 0.0, **parts: float) -> None:
        self.seconds += seconds
        self.tokens += tokens
        self.cpu_seconds += cpu
        self.per_call = [*(self.per_call or []), round(tokens / seconds, 1)]
        self.parts = self.parts or {}
        for k, v in parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + v

    def tokens_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def tokens_cpu_s(self) -> float:
        return self.tokens / self.cpu_seconds if self.cpu_seconds else 0.0


class TimedEngine:
    """The engine as the workflow sees it, with the seconds of its ``rollout`` calls kept."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rollout_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def rollout(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.engine.rollout(*args, **kwargs)
        finally:
            self.rollout_s += time.perf_counter() - t0


def engine_round(
    engine: Any, shape: Shape, tasks: list[Task], seed: int
) -> tuple[float, int, dict]:
    """The explorer's path once: the math workflow around the (serial) engine."""
    timed = TimedEngine(SerialEngine(engine))
    spec = RolloutSpec(
        repeat_times=shape.n,
        temperature=shape.temperature,
        max_new_tokens=shape.max_new_tokens,
        seed=seed,
        run="bench",
        explorer="explorer-0",
        model_version=0,
        prompts=PromptRenderer(engine.tokenizer),
    )
    t0 = time.perf_counter()
    groups = math_workflow(timed, tasks, get_reward(shape.reward), spec)
    seconds = time.perf_counter() - t0
    lengths = [int(e.response_length) for g in groups for e in g.experiences]
    parts = {
        "rollout_s": timed.rollout_s,
        "workflow_s": seconds - timed.rollout_s,
        "computed_tokens": len(lengths) * max(lengths),  # every row runs to the longest
    }
    return seconds, sum(lengths), parts


def alternate(
    rounds: int, sides: dict[str, Callable[[int], tuple[float, int, dict]]]
) -> dict[str, Tally]:
    """Each side once untimed (warm-up), then ``rounds`` rounds, the order flipped each
    round; the side's argument is the round's seed offset, the same for every side."""
    for run in sides.values():
        run(-1)
    tallies = {name: Tally() for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            cpu0 = time.process_time()
            seconds, tokens, parts = sides[name](r)
            tallies[name].add(seconds, tokens, cpu=time.process_time() - cpu0, **parts)
    return tallies


# -- transformers --------------------------------------------------------------------------


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def response_lengths(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per row: up to and including the first EOS, or the whole row."""
    is_eos = tokens == eos_id
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, tokens.shape[1])
    return first


def direct_generate(model: Any, tokenizer: Any, shape: Shape, prompts: list[list[int]], seed: int):
    """``model.generate`` with the engine's sampling settings, then the log-probs."""
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    torch.manual_seed(1_000 + seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=shape.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=shape.max_new_tokens,
            num_return_sequences=shape.n,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    t1 = time.perf_counter()
    new = out.sequences[:, ids.shape[1] :]
    # scores: the processed (temperature-scaled) logits of each step
    logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
    tok_logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
    lengths = response_lengths(new, tokenizer.eos_token_id)
    rows = [tok_logp[i, : int(n)].tolist() for i, n in enumerate(lengths)]
    t2 = time.perf_counter()
    tokens = sum(map(len, rows))
    parts = {"generate_s": t1 - t0, "logprobs_s": t2 - t1, "computed_tokens": new.numel()}
    return t2 - t0, tokens, parts


def bench_transformers(shape: Shape, rounds: int, seed: int) -> dict:
    model, tokenizer = load_policy(shape.model)
    engine = TransformersEngine(model, tokenizer)
    tasks = shape.make_tasks(seed)
    prompts = PromptRenderer(tokenizer).batch(tasks)
    tallies = alternate(
        rounds * shape.repeat,
        {
            "engine": lambda r: engine_round(engine, shape, tasks, seed + r),
            "direct": lambda r: direct_generate(model, tokenizer, shape, prompts, seed + r),
        },
    )
    eng, direct = tallies["engine"], tallies["direct"]
    assert eng.parts is not None and direct.parts is not None
    nolp = direct.tokens / direct.parts["generate_s"]
    computed = eng.parts["computed_tokens"], direct.parts["computed_tokens"]
    return summary(
        "transformers",
        shape,
        eng,
        direct,
        direct_nolp_tokens_s=round(nolp, 1),
        ratio_vs_direct_nolp=round(eng.tokens_s() / nolp, 4),
        # per position computed (rows x the longest response), which the random EOS of
        # the two sides' different streams does not move
        ratio_vs_direct_computed=round(
            (computed[0] / eng.seconds) / (computed[1] / direct.seconds), 4
        ),
        ratio_vs_direct_computed_cpu=round(
            (computed[0] / eng.cpu_seconds) / (computed[1] / direct.cpu_seconds), 4
        ),
    )


def summary(engine: str, shape: Shape, eng: Tally, direct: Tally, **more: Any) -> dict:
    ratio = eng.tokens_s() / direct.tokens_s()
    rollout_tokens_s = eng.tokens / eng.parts["rollout_s"] if eng.parts else 0.0
    res = {
        "engine": engine,
        "model": shape.name,
        "ratio_vs_direct": round(ratio, 4),
        "tokens_s": round(eng.tokens_s(), 1),
        "direct_tokens_s": round(direct.tokens_s(), 1),
        "framework_share": round(1 - ratio, 4),
        "rollout_ratio_vs_direct": round(rollout_tokens_s / direct.tokens_s(), 4),
        "ratio_vs_direct_cpu": round(eng.tokens_cpu_s() / direct.tokens_cpu_s(), 4),
        "tokens_cpu_s": round(eng.tokens_cpu_s(), 1),
        "direct_tokens_cpu_s": round(direct.tokens_cpu_s(), 1),
        "tokens": eng.tokens,
        "direct_tokens": direct.tokens,
        "seconds": round(eng.seconds, 3),
        "direct_seconds": round(direct.seconds, 3),
        **{k: round(v, 3) for k, v in (eng.parts or {}).items()},
        **{f"direct_{k}": round(v, 3) for k, v in (direct.parts or {}).items()},
        "per_call_tokens_s": eng.per_call,
        "direct_per_call_tokens_s": direct.per_call,
        "prompts": shape.tasks,
        "n": shape.n,
        "max_new_tokens": shape.max_new_tokens,
        "temperature": shape.temperature,
        **more,
    }
    say(
        f"[{engine}/{shape.name}] engine {res['tokens_s']} tok/s ({eng.tokens} tok,"
        f" {eng.seconds:.2f} s), direct {res['direct_tokens_s']} tok/s ({direct.tokens} tok,"
        f" {direct.seconds:.2f} s): ratio {res['ratio_vs_direct']} (CPU time:"
        f" {res['ratio_vs_direct_cpu']}), parts"
        f" {eng.parts} / {direct.parts}"
    )
    return res


# -- vLLM ----------------------------------------------------------------------------------


def direct_vllm(engine: Any, shape: Shape, prompts: list[list[int]], seed: int, seeded: bool):
    """``LLM.generate`` of the engine's own LLM, with the engine's SamplingParams (or one
    unseeded SamplingParams)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from streamrft.producers.engines.vllm_engine import _SEED_STRIDE

    def params(i: int) -> Any:
        return SamplingParams(
            n=shape.n,
            temperature=shape.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=shape.max_new_tokens,
            logprobs=0,
            seed=seed * _SEED_STRIDE + i * shape.n if seeded else None,
            detokenize=False,
        )

    t0 = time.perf_counter()
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    plist = [params(i) for i in range(len(prompts))] if seeded else params(0)
    outputs = engine.llm.generate(inputs, plist, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    return seconds, tokens, {}


def bench_vllm(shape: Shape, rounds: int, seed: int) -> dict:
    from streamrft.producers.engines.vllm_engine import VLLMEngine

    model, tokenizer = load_policy(shape.model)
    t0 = time.perf_counter()
    engine = VLLMEngine(model, tokenizer)
    start_s = time.perf_counter() - t0
    try:
        tasks = shape.make_tasks(seed)
        prompts = PromptRenderer(tokenizer).batch(tasks)
        tallies = alternate(
            rounds * shape.repeat,
            {
                "engine": lambda r: engine_round(engine, shape, tasks, seed + r),
                "direct": lambda r: direct_vllm(engine, shape, prompts, seed + r, True),
                "unseeded": lambda r: direct_vllm(engine, shape, prompts, seed + r, False),
            },
        )
    finally:
        engine.close()
    unseeded, unseeded_cpu = tallies["unseeded"].tokens_s(), tallies["unseeded"].tokens_cpu_s()
    return summary(
        "vllm",
        shape,
        tallies["engine"],
        tallies["direct"],
        direct_unseeded_tokens_s=round(unseeded, 1),
        ratio_vs_direct_unseeded=round(tallies["engine"].tokens_s() / unseeded, 4),
        ratio_vs_direct_unseeded_cpu=round(tallies["engine"].tokens_cpu_s() / unseeded_cpu, 4),
        engine_start_s=round(start_s, 1),
    )


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, one timed round")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    ap.add_argument("--models", default="tiny,smollm2", help="comma list: tiny,smollm2")
    ap.add_argument("--engines", default="transformers,vllm", help="comma list")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (explorer.threads)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    rounds = args.rounds or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    results: list[dict] = []
    skipped: dict[str, str] = {}
    engines = args.engines.split(",")
    if "vllm" in engines and importlib.util.find_spec("vllm") is None:
        skipped["vllm"] = "vllm does not import in this venv (run it with .venv-vllm/bin/python)"
        say(f"vllm: skipped, {skipped['vllm']}")
    for shape in shapes(args):
        if "transformers" in engines:
            results.append(bench_transformers(shape, rounds, args.seed))
        if "vllm" in engines and "vllm" not in skipped:
            results.append(bench_vllm(shape, rounds, args.seed))

    per_engine: dict[str, dict] = {}
    for res in results:  # the headline per engine: the largest model benched
        per_engine[res["engine"]] = {
            k: res[k]
            for k in (
                "model",
                "ratio_vs_direct",
                "tokens_s",
                "direct_tokens_s",
                "ratio_vs_direct_cpu",
            )
        }
    say(f"wall {time.perf_counter() - t_start:.1f} s")
    line = {
        "bench": "rollout",
        "engine": [
            {"engine": r["engine"], "model": r["model"], "ratio_vs_direct": r["ratio_vs_direct"]}
            for r in results
        ],
        "engines": per_engine,
        "results": results,
        "skipped": skipped,
        "rounds": rounds,
        "threads": args.threads,
        "torch": torch.__version__,
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
