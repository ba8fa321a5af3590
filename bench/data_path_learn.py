"""Does the new data path and its training controls learn like the default example?

For each seed, two ``streamrft run`` jobs of the default example (``examples/arithmetic.yaml``,
its own 150 steps, warm-up and peak rate), each with its own embedded services:

- ``jsonl`` (the baseline): the example as it is (JSONL taskset, constant learning rate,
  one optimizer update per pass);
- ``parquet``: the same tasks as a GSM8K-shaped Parquet file (``question``, a rationale
  ending ``#### N``) read through ``taskset.prompt_template`` and ``answer_extract:
  gsm8k``, a cosine schedule (5 warm-up steps, floor 0.1) and ``mini_batch_size: 16``
  (two updates per pass).

With ``--example smollm2`` the two arms are the SmolLM2 word-problem examples as they are:
``jsonl`` is ``examples/smollm2_wordproblems.yaml`` (chat tasks in JSONL), ``parquet`` is
``examples/smollm2_gsm8k_format.yaml`` (the same problems in GSM8K's columns, in Parquet,
read through a template and the ``gsm8k`` extractor); it needs ``streamrft models prepare
smollm2`` first and takes 20-30 minutes a run on a 2-core CPU. ``--arms`` runs some arms
only (the ratio is then left out).

Per run: greedy accuracy at each evaluation, the mean sampled reward of the first and last
steps, wall seconds. The final JSON line holds each arm's mean final accuracy and the ratio
parquet / jsonl (a learning benchmark, not a speed one: the wall times are this machine's).

    OMP_NUM_THREADS=1 python bench/data_path_learn.py --seeds 0 1 2
    OMP_NUM_THREADS=1 python bench/data_path_learn.py --example smollm2 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.gsm8k_shape import OVERRIDES, write_gsm8k_shaped  # noqa: E402

EXAMPLE = ROOT / "examples" / "arithmetic.yaml"
SMOLLM2 = {
    "jsonl": ROOT / "examples" / "smollm2_wordproblems.yaml",
    "parquet": ROOT / "examples" / "smollm2_gsm8k_format.yaml",
}
ARMS = ("jsonl", "parquet")
CONTROLS = (
    "trainer.lr_schedule=cosine",
    "trainer.lr_warmup_steps=5",
    "trainer.min_lr_ratio=0.1",
    "trainer.mini_batch_size=16",
)


def run(example: str, arm: str, seed: int, work: Path, data: Path) -> dict:
    summary = work / f"{arm}-{seed}.json"
    if example == "smollm2":
        config, settings = SMOLLM2[arm], [f"run.seed={seed}"]
    else:
        config = EXAMPLE
        settings = [f"run.seed={seed}", f"model.seed={seed}", "eval.interval=50"]
        if arm == "parquet":
            settings += [f"taskset.path={data}", *OVERRIDES, *CONTROLS]
    argv = [sys.executable, "-m", "streamrft.app.cli", "run", str(config), "--no-progress"]
    argv += ["--summary", str(summary), "-o", f"run.dir={work / 'runs'}"]
    for s in settings:
        argv += ["-o", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed:\n{done.stderr[-3000:]}")
    s = json.loads(summary.read_text())
    row = {
        "example": example,
        "arm": arm,
        "seed": seed,
        "eval_accuracy": s["eval_accuracy"],
        "accuracy_first": s["eval_accuracy_first"],
        "accuracy_last": s["eval_accuracy_last"],
        "reward_first": round(s["mean_reward_first"], 4),
        "reward_last": round(s["mean_reward_last"], 4),
        "wall_s": s.get("wall_s"),
    }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--example", choices=("arithmetic", "smollm2"), default="arithmetic")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="data-path-learn-") as tmp:
        work = Path(tmp)
        data = write_gsm8k_shaped(work / "addition.parquet")
        rows = [
            run(args.example, arm, seed, work, data) for seed in args.seeds for arm in args.arms
        ]

    def mean_last(arm: str) -> float:
        last = [r["accuracy_last"] for r in rows if r["arm"] == arm]
        return sum(last) / len(last)

    result: dict = {"bench": "data_path_learn", "example": args.example, "seeds": args.seeds}
    result["runs"] = rows
    for arm in args.arms:
        result[f"{arm}_accuracy_last_mean"] = round(mean_last(arm), 4)
    if set(args.arms) == set(ARMS):
        result["parquet_over_jsonl"] = round(mean_last("parquet") / mean_last("jsonl"), 4)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
