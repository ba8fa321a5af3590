"""Mutation testing of one module: does any test notice when its logic changes?

Each mutant is one small change of the module's syntax tree: a comparison flipped at its
boundary (``<`` and ``<=``, ``==`` and ``!=``, ``in`` and ``not in``), ``and`` for ``or``
and back, ``+`` for ``-``, an integer constant off by one, or a guard removed (the test of
an ``if`` whose body raises, made ``False``). The module's file is replaced by each mutant
in turn, the given tests run (``pytest -x -q``, stop at the first failure), and the
original is put back, whatever happens (a copy is kept beside it until then). A mutant the
tests fail on is *killed*; one they pass is a *survivor*: either a gap in the tests or a
change that makes no difference (an equivalent mutant), which only a reader can tell.

Opt-in, not part of ``make test`` (each mutant is a test run)::

    python -m tools.mutate sync/delta.py tests/unit/test_delta.py tests/unit/test_delta_guards.py
    python -m tools.mutate schemas/codec.py tests/unit/test_codec_edges.py --json out.json

The last line is one JSON object: ``{"module", "mutants", "killed", "survived",
"kill_rate", "survivors": [{"line", "change"}, ...]}``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FLIP_COMPARE = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
FLIP_BOOL = {ast.And: ast.Or, ast.Or: ast.And}
FLIP_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add}


@dataclass(frozen=True)
class Mutant:
    index: int
    line: int
    change: str


def _sites(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Every node a mutant changes, with what the change is, in a fixed order."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in FLIP_COMPARE:
                    yield node, f"compare:{i}"
        elif isinstance(node, ast.BoolOp) and type(node.op) in FLIP_BOOL:
            yield node, "bool"
        elif isinstance(node, ast.BinOp) and type(node.op) in FLIP_BIN:
            yield node, "bin"
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            yield node, "const"
        elif isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body):
            yield node, "guard"


def _apply(node: ast.AST, kind: str) -> str:
    """Change ``node`` in place; a description of the change."""
    before = ast.unparse(node).splitlines()[0][:80]
    if kind.startswith("compare:"):
        i = int(kind.partition(":")[2])
        node.ops[i] = FLIP_COMPARE[type(node.ops[i])]()
    elif kind == "bool":
        node.op = FLIP_BOOL[type(node.op)]()
    elif kind == "bin":
        node.op = FLIP_BIN[type(node.op)]()
    elif kind == "const":
        node.value = node.value + 1
    elif kind == "guard":
        node.test = ast.Constant(False)
    after = ast.unparse(node).splitlines()[0][:80]
    return f"{before} -> {after}"


def mutants(source: str) -> Iterator[tuple[Mutant, str]]:
    """Each mutant of ``source`` and its source text."""
    tree = ast.parse(source)
    count = sum(1 for _ in _sites(tree))
    for index in range(count):
        mutated = copy.deepcopy(tree)
        node, kind = list(_sites(mutated))[index]
        change = _apply(node, kind)
        yield Mutant(index, getattr(node, "lineno", 0), change), ast.unparse(mutated)


def run(module: Path, tests: list[str], timeout_s: float) -> dict:
    original = module.read_text()
    backup = module.with_name(module.name + ".mutate-backup")
    if backup.exists():
        raise SystemExit(f"{backup} exists: a run was interrupted; put it back first")
    shutil.copy2(module, backup)
    killed, survivors, total = 0, [], 0
    try:
        for mutant, text in mutants(original):
            total += 1
            module.write_text(text)
            t0 = time.monotonic()
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                    capture_output=True,
                    timeout=timeout_s,
                    # no bytecode: a mutant of the same size written in the same second as
                    # the one before must not be read from its stale .pyc
                    env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"},
                )
                dead = proc.returncode != 0
            except subprocess.TimeoutExpired:
                dead = True  # a mutant that hangs the tests is noticed
            verdict = "killed" if dead else "SURVIVED"
            print(
                f"#{mutant.index:3d} line {mutant.line:4d} {verdict:8s} "
                f"({time.monotonic() - t0:.1f} s) {mutant.change}",
                flush=True,
            )
            if dead:
                killed += 1
            else:
                survivors.append({"line": mutant.line, "change": mutant.change})
    finally:
        shutil.copy2(backup, module)
        backup.unlink()
    return {
        "module": str(module),
        "mutants": total,
        "killed": killed,
        "survived": len(survivors),
        "kill_rate": round(killed / total, 4) if total else None,
        "survivors": survivors,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module", type=Path, help="the module to mutate, e.g. sync/delta.py")
    ap.add_argument("tests", nargs="+", help="the tests that should notice (pytest paths)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test run")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    if not args.module.is_file():
        ap.error(f"no module {args.module}")
    result = run(args.module, args.tests, args.timeout)
    line = json.dumps(result)
    if args.json:
        args.json.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
