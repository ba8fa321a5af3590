"""Benchmark: trainer tokens/s through streamrft's training step against a plain PyTorch loop.

Both paths train the same tiny Llama (``model.source: tiny``, the shape of
``examples/arithmetic.yaml`` unless told otherwise) from the same initial weights, with
AdamW of the same hyper-parameters, on the same batches (the very same
``ExperienceGroup`` objects), alternating step by step in one process:

- framework: the real train engine, ``make_train_engine(cfg)`` then ``engine.prepare()``,
  and per step ``engine.train_step(groups, 0)`` (collate, GRPO advantages, ``ppo_epochs``
  passes of the clipped surrogate over the configured micro-batches, grad clipping, the
  step's metrics), with the config's algorithm defaults (GRPO, clip 0.2/0.2,
  ``token-mean``, no KL, std-normalised advantages);
- plain: a loop written here as a user would write it, independent of streamrft's
  algorithm code: numpy collate (left-padded prompts, right-padded responses: the layout
  the explorer samples with), group-normalised advantages (mean / (unbiased std + 1e-6)),
  then per PPO epoch one forward, log-softmax gather, ratio against the rollout log-probs,
  clipped surrogate, token mean over the mask, backward, grad-norm clipping, AdamW step;
  one ``loss.item()`` per step (a user logs the loss).

Batches are synthetic but valid: ``--groups`` groups of ``--repeat`` rollouts, random token
ids below the vocabulary, prompt lengths ``--prompt-len`` +- 2 (shared by a group's
rollouts), response lengths uniform in [``--response-len``/2, ``--response-len``], action
masks of ones, rewards in {0, 1} (every fourth group all equal: no signal), model version
0, and log-probs the initial model's own for those tokens (so the first ratio is 1, as in
a real run; ``first_logprob_diff`` is the framework's check of it).

The paths alternate (framework then plain on even steps, plain then framework on odd ones);
``--warmup-steps`` steps of each run first, untimed. After the first step the two models'
weights are compared: ``max_weight_diff`` (max |difference| over every parameter) is ~1e-7
when the two compute the same math; ``final_weight_diff`` after the last step (Adam
amplifies float noise on near-zero gradients, so it grows slowly).

Figures: a step's tokens are the sum of its sequences' unpadded lengths (prompt +
response), counted once per step whatever ``ppo_epochs``; ``tokens_s`` (framework) and
``plain_tokens_s`` are all timed steps' tokens over their summed step seconds;
``ratio_vs_plain`` = ``tokens_s`` / ``plain_tokens_s`` (1.0: no framework overhead);
``ratio_median`` and ``ratio_min`` the same from the median and the fastest step times
(less sensitive to a busy machine: the fastest step is the least disturbed);
``cpu_step_ms``, ``plain_cpu_step_ms`` and ``ratio_cpu`` the same from this process's CPU
time (``time.process_time``; one thread, so waiting for a core shared with other
processes is not counted).
``--profile``: afterwards, ``--steps`` more steps of each path under cProfile; the top
functions by cumulative time go to stderr and ``profile`` (seconds per step of the
framework's phases) into the JSON.

Usage: ``python bench/train_step.py [--steps 30] [--groups 32] [--response-len 16]
[--profile]``. Progress on stderr; one JSON line on stdout. One torch thread. A figure, not
a test: nothing is asserted beyond the two paths' weights agreeing.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from streamrft.consumers.train_engine import TrainEngine, make_train_engine
from streamrft.infra.config import Config, from_dict
from streamrft.infra.modeling import load_policy
from streamrft.schemas.experience import Experience, ExperienceGroup, make_group_id

TASKSET = Path(__file__).resolve().parents[1] / "examples" / "data" / "addition.jsonl"
FIRST_TOKEN = 4  # below: <pad> <s> </s> <unk>
PROFILED = {
    "policy_step": ("step.py", "policy_step"),
    "prepare_inputs": ("step.py", "prepare_inputs"),
    "collate": ("batching.py", "collate"),
    "resolve_algorithm": ("presets.py", "resolve_algorithm"),
    "micro_slices": ("batching.py", "micro_slices"),
    "prompt_lengths": ("batching.py", "prompt_lengths"),
    "response_lengths": ("batching.py", "response_lengths"),
    "rows": ("step.py", "rows"),
    "micro_batch_loss": ("step.py", "micro_batch_loss"),
    "response_logprobs": ("batching.py", "response_logprobs"),
    "policy_loss": ("policy_losses.py", "clipped_surrogate"),
    "backward": ("precision.py", "backward"),
    "optimizer_step": ("precision.py", "step"),
    "logprob_drift": ("step.py", "logprob_drift"),
    "mismatch_add": ("step.py", "add"),
    "step_metrics": ("step.py", "step_metrics"),
}
"""JSON name -> (file name, function) of the framework's phases reported by ``--profile``."""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the config and the batches ----------------------------------------------------------------
def make_config(args: argparse.Namespace, run_dir: str) -> Config:
    """The default example's trainer (``examples/arithmetic.yaml``) at the bench's sizes.
    Only fields that every version of the config has; the algorithm is the defaults'."""
    return from_dict(
        {
            "run": {"name": "bench-train-step", "dir": run_dir, "seed": args.seed},
            "model": {
                "source": "tiny",
                "hidden_size": args.hidden,
                "intermediate_size": 4 * args.hidden,
                "num_layers": args.layers,
                "num_heads": args.heads,
                "max_positions": max(64, args.prompt_len + 2 + args.response_len),
                "seed": args.seed,
            },
            "taskset": {"path": str(TASKSET)},
            "explorer": {
                "repeat_times": args.repeat,
                "max_new_tokens": args.response_len,
                "temperature": 1.0,
            },
            "trainer": {
                "batch_size": args.groups,
                "ppo_epochs": args.ppo_epochs,
                "micro_batch_size": args.micro_batch_size,
                "lr": 5e-4,
                "grad_clip": 1.0,
                "max_staleness": 1,
                "threads": 1,
            },
        }
    )


def make_batch(
    rng: np.random.Generator, args: argparse.Namespace, vocab: int, index: int
) -> list[ExperienceGroup]:
    """One step's groups; log-probs left empty (:func:`fill_logprobs` sets them)."""
    groups = []
    for g in range(args.groups):
        gid = make_group_id("bench", f"task-{index:04d}-{g:03d}", 0)
        prompt = rng.integers(FIRST_TOKEN, vocab, max(1, args.prompt_len + rng.integers(-2, 3)))
        if g % 4 == 3:  # all equal: zero advantages, no signal
            rewards = np.full(args.repeat, float(rng.integers(0, 2)))
        else:
            rewards = rng.integers(0, 2, args.repeat).astype(float)
        exps = []
        for i in range(args.repeat):
            n = int(rng.integers(max(1, args.response_len // 2), args.response_len + 1))
            tokens = np.concatenate([prompt, rng.integers(FIRST_TOKEN, vocab, n)])
            exps.append(
                Experience(
                    id=f"{gid}#{i}",
                    tokens=tokens.astype("<i4").tobytes(),
                    prompt_length=len(prompt),
                    logprobs=b"",
                    action_mask=np.ones(n, dtype=np.uint8).tobytes(),
                    reward=float(rewards[i]),
                    model_version=0,
                )
            )
        groups.append(
            ExperienceGroup(
                id=gid,
                run="bench",
                task_id=f"task-{index:04d}-{g:03d}",
                explorer="explorer-0",
                model_version=0,
                experiences=exps,
            )
        )
    return groups


@torch.no_grad()
def fill_logprobs(model: torch.nn.Module, groups: list[ExperienceGroup], pad_id: int) -> None:
    """Each experience's log-probs: the model's own for its response tokens (eval mode)."""
    batch = plain_collate(groups, pad_id)
    logp = plain_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width)
    exps = [e for g in groups for e in g.experiences]
    for i, e in enumerate(exps):
        e.logprobs = logp[i, : e.response_length].numpy().astype("<f4").tobytes()


def step_tokens(groups: list[ExperienceGroup]) -> int:
    """Unpadded prompt + response tokens of a step's sequences."""
    return sum(e.num_tokens for g in groups for e in g.experiences)


# -- the plain loop ------------------------------------------------------------------------------
@dataclass
class PlainBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    rewards: torch.Tensor  # (groups, repeat)


def plain_collate(groups: list[ExperienceGroup], pad_id: int) -> PlainBatch:
    """Left-padded prompts, right-padded responses, via numpy."""
    exps = [e for g in groups for e in g.experiences]
    width_p = max(e.prompt_length for e in exps)
    width_r = max(e.response_length for e in exps)
    b = len(exps)
    ids = np.full((b, width_p + width_r), pad_id, dtype=np.int64)
    attn = np.zeros((b, width_p + width_r), dtype=np.int64)
    mask = np.zeros((b, width_r), dtype=np.float32)
    old = np.zeros((b, width_r), dtype=np.float32)
    for i, e in enumerate(exps):
        p, r = e.prompt_length, e.response_length
        ids[i, width_p - p : width_p + r] = np.frombuffer(e.tokens, dtype="<i4")
        attn[i, width_p - p : width_p + r] = 1
        mask[i, :r] = np.frombuffer(e.action_mask, dtype=np.uint8)
        if e.logprobs:
            old[i, :r] = np.frombuffer(e.logprobs, dtype="<f4")
    rewards = np.array([[e.reward for e in g.experiences] for g in groups], dtype=np.float32)
    return PlainBatch(
        torch.from_numpy(ids),
        torch.from_numpy(attn),
        width_p,
        torch.from_numpy(mask),
        torch.from_numpy(old),
        torch.from_numpy(rewards),
    )


def plain_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, width_p: int
) -> torch.Tensor:
    positions = (attn.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, width_p - 1 : -1].float(), dim=-1)
    return logp.gather(-1, ids[:, width_p:, None]).squeeze(-1)


class PlainTrainer:
    """GRPO written out: the loop a user would write without the framework."""

    def __init__(self, cfg: Config, init: dict[str, torch.Tensor]) -> None:
        self.model, tokenizer = load_policy(cfg.model, dtype=torch.float32)
        self.model.load_state_dict(init)
        self.pad_id = tokenizer.pad_token_id
        t = cfg.trainer
        self.epochs, self.clip, self.grad_clip = t.ppo_epochs, 0.2, t.grad_clip
        self.rows = t.micro_batch_size
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=t.betas
        )

    def train_step(self, groups: list[ExperienceGroup]) -> float:
        b = plain_collate(groups, self.pad_id)
        r = b.rewards
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1, 1)
        n_tokens = b.mask.sum().clamp_min(1.0)
        cuts = range(0, len(adv), self.rows or len(adv))
        self.model.train()
        for _ in range(self.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for lo in cuts:
                hi = lo + (self.rows or len(adv))
                logp = plain_logprobs(
                    self.model, b.input_ids[lo:hi], b.attention_mask[lo:hi], b.prompt_width
                )
                ratio = torch.exp(logp - b.old_logprobs[lo:hi])
                a = adv[lo:hi]
                surrogate = torch.minimum(
                    ratio * a, torch.clamp(ratio, 1 - self.clip, 1 + self.clip) * a
                )
                loss = -(surrogate * b.mask[lo:hi]).sum() / n_tokens
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
        self.model.eval()
        return total


# -- timing ---------------------------------------------------------------------------------------
def max_weight_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sb = b.state_dict()
    return max(float((v - sb[k]).abs().max()) for k, v in a.state_dict().items())


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and this process's CPU seconds of ``fn()``."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def run_steps(
    engine: TrainEngine,
    plain: PlainTrainer,
    batches: list[list[ExperienceGroup]],
    warmup: int,
) -> tuple[list[tuple[float, float]], list[tuple[float, float]], float, float]:
    """Alternate the two paths over ``batches`` (the first ``warmup`` untimed): their step
    (wall, CPU) seconds, the weight difference after the first step, and the framework's
    first log-prob drift."""
    fw, pl, diff, drift = [], [], float("nan"), float("nan")
    for k, groups in enumerate(batches):
        run_fw = lambda g=groups: engine.train_step(g, 0)  # noqa: E731
        run_pl = lambda g=groups: plain.train_step(g)  # noqa: E731
        if k == 0:
            drift = engine.train_step(groups, 0)["train/logprob_max_abs_diff"]
            plain.train_step(groups)
            diff = max_weight_diff(engine.model, plain.model)  # type: ignore[attr-defined]
            say(
                f"after step 1: max |weight difference| {diff:.2e}, first log-prob drift {drift:.2e}"
            )
            continue
        if k % 2 == 0:
            t_fw, t_pl = timed(run_fw), timed(run_pl)
        else:
            t_pl, t_fw = timed(run_pl), timed(run_fw)
        if k >= warmup:
            fw.append(t_fw)
            pl.append(t_pl)
            if len(fw) % 10 == 0:
                say(
                    f"step {len(fw)}: framework {t_fw[0] * 1e3:.1f} ms, "
                    f"plain {t_pl[0] * 1e3:.1f} ms (wall)"
                )
    return fw, pl, diff, drift


def profile_paths(
    engine: TrainEngine, plain: PlainTrainer, batches: list[list[ExperienceGroup]]
) -> dict[str, float]:
    """Each path under cProfile over ``batches``; top functions to stderr, the framework's
    phases (seconds per step) returned."""
    out: dict[str, float] = {}
    for name, step in (
        ("framework", lambda g: engine.train_step(g, 0)),
        ("plain", plain.train_step),
    ):
        prof = cProfile.Profile()
        prof.enable()
        for groups in batches:
            step(groups)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(30)
        say(f"--- cProfile, {name} path, {len(batches)} steps (cumulative s over all) ---")
        say(text.getvalue())
        if name == "framework":
            table = stats.stats  # type: ignore[attr-defined]
            for key, (file, func) in PROFILED.items():
                ct = sum(v[3] for (f, _, fn), v in table.items() if fn == func and f.endswith(file))
                out[key] = round(ct / len(batches), 6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=32, help="groups per step (trainer.batch_size)")
    ap.add_argument("--repeat", type=int, default=8, help="rollouts per group (repeat_times)")
    ap.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (+-2)")
    ap.add_argument("--response-len", type=int, default=16, help="longest response")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per path")
    ap.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first")
    ap.add_argument("--ppo-epochs", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=0, help="rows (0: whole batch)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile both paths afterwards")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup_steps < 1:
        ap.error("--steps and --warmup-steps must be >= 1")
    torch.set_num_threads(1)
    t_start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="streamrft-bench-train-") as run_dir:
        cfg = make_config(args, run_dir)
        engine = make_train_engine(cfg)
        engine.prepare()
        model = engine.model  # type: ignore[attr-defined]
        pad_id = engine.tokenizer.pad_token_id  # type: ignore[attr-defined]
        plain = PlainTrainer(cfg, model.state_dict())
        rng = np.random.default_rng(args.seed)
        batches = [
            make_batch(rng, args, engine.vocab_size, k)
            for k in range(args.warmup_steps + args.steps)
        ]
        for groups in batches:
            fill_logprobs(model, groups, pad_id)
        tokens = [step_tokens(g) for g in batches]
        say(
            f"{args.groups} groups x {args.repeat} rollouts, prompt {args.prompt_len}+-2, "
            f"response <= {args.response_len}, {statistics.mean(tokens):.0f} tokens/step; "
            f"{args.warmup_steps} warm-up + {args.steps} timed steps per path, alternating"
        )
        fw_times, pl_times, diff, drift = run_steps(engine, plain, batches, args.warmup_steps)
        final_diff = max_weight_diff(model, plain.model)
        timed_tokens = sum(tokens[args.warmup_steps :])
        profile = profile_paths(engine, plain, batches[args.warmup_steps :]) if args.profile else {}

    fw, fw_cpu = [t[0] for t in fw_times], [t[1] for t in fw_times]
    pl, pl_cpu = [t[0] for t in pl_times], [t[1] for t in pl_times]
    fw_s, pl_s = sum(fw), sum(pl)
    result = {
        "bench": "train_step",
        "groups": args.groups,
        "repeat": args.repeat,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "ppo_epochs": args.ppo_epochs,
        "micro_batch_size": args.micro_batch_size,
        "hidden": args.hidden,
        "layers": args.layers,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "tokens_per_step": round(timed_tokens / args.steps, 1),
        "step_ms": round(fw_s / args.steps * 1e3, 2),
        "plain_step_ms": round(pl_s / args.steps * 1e3, 2),
        "step_ms_median": round(statistics.median(fw) * 1e3, 2),
        "plain_step_ms_median": round(statistics.median(pl) * 1e3, 2),
        "ratio_median": round(statistics.median(pl) / statistics.median(fw), 3),
        "ratio_min": round(min(pl) / min(fw), 3),
        "cpu_step_ms": round(sum(fw_cpu) / args.steps * 1e3, 2),
        "plain_cpu_step_ms": round(sum(pl_cpu) / args.steps * 1e3, 2),
        "ratio_cpu": round(sum(pl_cpu) / sum(fw_cpu), 3),
        "max_weight_diff": diff,
        "final_weight_diff": final_diff,
        "first_logprob_diff": drift,
        **({"profile": profile} if profile else {}),
        "tokens_s": round(timed_tokens / fw_s, 1),
        "plain_tokens_s": round(timed_tokens / pl_s, 1),
        "ratio_vs_plain": round(pl_s / fw_s, 3),
    }
    say(
        f"framework {result['tokens_s']} tokens/s, plain {result['plain_tokens_s']} tokens/s, "
        f"ratio {result['ratio_vs_plain']} (median {result['ratio_median']}, "
        f"fastest {result['ratio_min']}, CPU time {result['ratio_cpu']}); "
        f"wall {time.perf_counter() - t_start:.1f} s"
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
