"""A user reward module, named in config as ``tests.helpers.rewards_example:short_answer``."""

from __future__ import annotations

from streamrft.schemas.experience import Task


def short_answer(response_text: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 for a response no longer than the answer (a toy, unlike the built-ins)."""
    short = len(response_text.strip()) <= len(task.answer)
    return float(short), {"short": float(short), "chars": float(len(response_text))}


NOT_A_FUNCTION = 3
"""Not callable: naming it is a config error."""


def one_argument(response_text: str) -> tuple[float, dict[str, float]]:
    """Cannot be called as (response_text, task): naming it is a config error."""
    return 0.0, {}
