"""``streamrft tasks make NAME --n N --seed S --out FILE``: write a generated task set
(JSONL, or Parquet where ``FILE`` ends ``.parquet``; ``--shape gsm8k`` for GSM8K's columns).

The generators live in :mod:`streamrft.producers.tasksets`; this command writes the
training split to ``--out`` and the eval split (``--eval-n`` tasks none of the training
ones) to ``--eval-out`` (default ``<out>.eval.jsonl``), for ``taskset.path`` and
``eval.path``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_tasks_make(args: argparse.Namespace) -> int:
    from streamrft.producers.tasksets import eval_path_for, make_splits, write_rows

    kinds = args.kinds.split(",") if args.kinds else None
    train, evals = make_splits(
        args.name,
        args.n,
        args.eval_n,
        args.seed,
        max_number=args.max_number,
        kinds=kinds,
        shape=args.shape,
    )
    out = Path(args.out)
    print(f"{len(train)} tasks written to {write_rows(train, out)}")
    if evals:
        eval_out = Path(args.eval_out) if args.eval_out else eval_path_for(out)
        print(f"{len(evals)} eval tasks written to {write_rows(evals, eval_out)}")
    return 0


def add_tasks_parser(sub: argparse._SubParsersAction) -> None:
    """``tasks make`` under the ``streamrft`` parser's subcommands ``sub``."""
    tasks = sub.add_parser("tasks", help="generate task sets locally")
    actions = tasks.add_subparsers(dest="action", required=True, help="make: write a task set")
    sp = actions.add_parser("make", help="write a generated task set (JSONL) and its eval split")
    sp.add_argument("name", help="generator: word_problems (arithmetic word problems, chat)")
    sp.add_argument("--n", type=int, default=1000, help="training tasks (default 1000)")
    sp.add_argument("--eval-n", type=int, default=100, help="eval tasks, 0: none (default 100)")
    sp.add_argument("--seed", type=int, default=0, help="seed: the same seed, the same tasks")
    sp.add_argument(
        "--max-number", type=int, default=49, help="largest number in a question (default 49)"
    )
    sp.add_argument(
        "--kinds",
        help="comma-separated templates (default all): add, sub, mul, div, add_sub, sub_sub, "
        "mul_add",
    )
    sp.add_argument(
        "--shape",
        default="chat",
        choices=("chat", "gsm8k"),
        help="rows: chat (messages + answer, default) or gsm8k (question + a rationale "
        "ending '#### N', GSM8K's columns)",
    )
    sp.add_argument(
        "--out", required=True, help="file of the training tasks: JSONL, or Parquet (.parquet)"
    )
    sp.add_argument(
        "--eval-out", help="file of the eval tasks (default <out>.eval.jsonl or .eval.parquet)"
    )
    sp.set_defaults(func=cmd_tasks_make)
