"""How much each algorithm preset learns the default example's task in the same budget.

Every preset of ``consumers/algorithms/presets.py`` (``sft`` on the tasks' answers, the
others on the policy's own samples) trains the tiny model from the same warm start (the
default example's SFT warm-up) for ``--steps`` steps of ``--tasks`` tasks x 8 rollouts, in
one process (``tests/helpers/learning.py``: the real train and rollout engines, no
broker); ``chord`` mixes in the answers of the same task set, ``on_policy_distill``
learns from a teacher trained by SFT first. Per preset and seed: greedy accuracy on the 100 problems before and after, and
the mean sampled reward of the first and last 5 steps. With ``--lag K`` the explorer
samples with the weights of K versions ago, and ``--correction`` names the off-policy
correction to compare against none.

The baseline is ``grpo`` in the same run: the final JSON line holds each preset's mean
accuracy gain and its ratio to grpo's.

    OMP_NUM_THREADS=1 python bench/presets_learn.py --seeds 0 1 2
    OMP_NUM_THREADS=1 python bench/presets_learn.py --presets grpo --lag 4 \\
        --correction truncated_is_token
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from streamrft.consumers.algorithms import ALGORITHMS
from tests.helpers.learning import ADDITION, learn, sft_teacher


def settings(preset: str, seed: int, args: argparse.Namespace, scratch: Path) -> dict:
    """What a preset needs besides its name: its expert data (``chord``, mu decaying over
    the run) or its teacher (``on_policy_distill``: the warm start after 160 more SFT
    steps, about 0.95 accuracy)."""
    if preset == "chord":
        return {"expert_data": str(ADDITION), "sft_weight_steps": args.steps}
    if preset == "on_policy_distill":
        teacher = scratch / f"teacher-{seed}"
        if not teacher.exists():
            sft_teacher(seed, 160, teacher)
        return {"teacher_path": str(teacher)}
    return {}


def run_one(
    preset: str, seed: int, args: argparse.Namespace, correction: str, scratch: Path
) -> dict:
    algorithm = {
        "type": preset,
        "off_policy_correction": correction,
        **settings(preset, seed, args, scratch),
    }
    workflow = {"sft": "expert", "dpo": "preference"}.get(preset, "math")
    t0 = time.perf_counter()
    result = learn(algorithm, args.steps, seed, args.tasks, lag=args.lag, workflow=workflow)
    head, tail = result.rewards[:5], result.rewards[-5:]
    return {
        "preset": preset,
        "correction": correction,
        "seed": seed,
        "accuracy_before": result.accuracy_before,
        "accuracy_after": result.accuracy_after,
        "reward_first5": sum(head) / len(head),
        "reward_last5": sum(tail) / len(tail),
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="*", default=list(ALGORITHMS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tasks", type=int, default=32, help="tasks per step (x 8 rollouts)")
    parser.add_argument("--lag", type=int, default=0, help="explorer versions behind")
    parser.add_argument("--correction", default="", help="also run with this correction")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp(prefix="presets-learn-"))
    rows = []
    corrections = ["none"] + ([args.correction] if args.correction else [])
    for preset in dict.fromkeys(["grpo", *args.presets]):
        if preset not in ALGORITHMS:
            parser.error(f"unknown preset {preset!r}; known: {', '.join(ALGORITHMS)}")
        for correction in corrections:
            for seed in args.seeds:
                row = run_one(preset, seed, args, correction, scratch)
                rows.append(row)
                print(
                    f"{preset:30s} {correction:22s} seed {seed}: accuracy "
                    f"{row['accuracy_before']:.2f} -> {row['accuracy_after']:.2f}, reward "
                    f"{row['reward_first5']:.2f} -> {row['reward_last5']:.2f} "
                    f"({row['seconds']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

    def gain(preset: str, correction: str) -> float:
        mine = [r for r in rows if r["preset"] == preset and r["correction"] == correction]
        return sum(r["accuracy_after"] - r["accuracy_before"] for r in mine) / len(mine)

    base = gain("grpo", "none")
    summary = {
        f"{p}{'' if c == 'none' else '+' + c}": {
            "accuracy_gain": round(gain(p, c), 3),
            "ratio_vs_grpo": round(gain(p, c) / base, 3) if base else None,
        }
        for p in dict.fromkeys(r["preset"] for r in rows)
        for c in corrections
    }
    print(
        json.dumps(
            {
                "bench": "presets_learn",
                "steps": args.steps,
                "seeds": args.seeds,
                "lag": args.lag,
                "rows": rows,
                "presets": summary,
            }
        )
    )


if __name__ == "__main__":
    main()
