"""The GSM8K recipes (``examples/gsm8k/*.yaml``) as the tests read them: on the local
sample data and a Qwen-shaped folder, and the plan lines each file's comment block holds."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.paths import ROOT

RECIPES = sorted((ROOT / "examples" / "gsm8k").glob("*.yaml"))
SAMPLE = ROOT / "examples" / "data" / "gsm8k_format_sample.parquet"
EVAL_SAMPLE = ROOT / "examples" / "data" / "gsm8k_format_sample.eval.parquet"
PLAN_MARK = "# `streamrft plan`"


def local_overrides(model: Path) -> list[str]:
    """``-o`` settings that point a recipe at the local sample and ``model``."""
    settings = [f"model.path={model}", f"taskset.path={SAMPLE}", f"eval.path={EVAL_SAMPLE}"]
    return [arg for s in settings for arg in ("-o", s)]


def plan_lines(plan) -> list[str]:
    """The comment lines a recipe carries for ``plan`` (an ``app.plan.Plan``)."""
    from streamrft.infra.memory_plan import GIB

    lines = [f"#   {n:<15} {d:<7} {e.total / GIB:6.2f} GiB" for n, d, e in plan.processes]
    for device, total in plan.by_device().items():
        verdict = "fits" if total <= plan.device_bytes else "does NOT fit"
        lines.append(
            f"#   {device}: {total / GIB:.2f} of {plan.device_bytes / GIB:.0f} GiB: {verdict}"
        )
    return lines


def comment_plan(text: str) -> list[str]:
    """The plan lines of a recipe's comment block (after its ``streamrft plan`` line, up to
    the first comment line that is not indented)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(PLAN_MARK)) + 1
    out = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        out.append(line)
    return out
