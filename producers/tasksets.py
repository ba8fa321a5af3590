"""Task sets generated locally, for real small models: ``streamrft tasks make NAME``.

``word_problems``: arithmetic word problems of one or two operations on numbers under 50
(``max_number``; ``kinds`` picks the templates) ("Tom has 7 apples and buys 5 more. How
many apples does Tom have now?" -> 12), as chat
tasks (``messages``) that ask for the answer in ``<answer></answer>`` tags, scored by the
``math_answer_format`` (or ``math_answer``) reward. Deterministic by seed; the eval split
holds problems the training split does not.

Each line: ``{"id", "messages": [{"role": "user", "content"}], "answer", "kind"}``;
``kind`` (the template) is kept as task metadata.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from streamrft.schemas.errors import ConfigError

INSTRUCTION = "Give the final answer, a number only, between <answer> and </answer>."
"""Appended to every question (on its own line)."""

NAMES = ("Tom", "Ann", "Sam", "Lily", "Max", "Mia", "Ben", "Zoe", "Leo", "Eva")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards")

Problem = tuple[str, int, str]
"""(question, answer, rationale): the rationale is GSM8K's kind of worked solution, each
calculation written ``a + b = <<a+b=c>>c``, without the final ``#### answer`` line."""


def _calc(expr: str, value: int) -> str:
    """A calculation as GSM8K writes it: ``7 + 5 = <<7+5=12>>12``."""
    return f"{expr} = <<{expr.replace(' ', '')}={value}>>{value}"


def _add(r: random.Random, who: str, friend: str, item: str, hi: int) -> Problem:
    a, b = r.randint(1, hi), r.randint(1, hi)
    q = f"{who} has {a} {item} and buys {b} more. How many {item} does {who} have now?"
    return q, a + b, f"{who} has {_calc(f'{a} + {b}', a + b)} {item} now."


def _sub(r: random.Random, who: str, friend: str, item: str, hi: int) -> Problem:
    a = r.randint(2, hi)
    b = r.randint(1, a - 1)
    q = f"{who} has {a} {item} and gives {b} to {friend}. How many {item} does {who} have left?"
    return q, a - b, f"{who} has {_calc(f'{a} - {b}', a - b)} {item} left."


def _mul(r: random.Random, who: str, friend: str, item: str, hi: int) -> Problem:
    a, b = r.randint(2, min(9, hi)), r.randint(2, min(12, hi))
    q = f"{who} buys {a} bags with {b} {item} in each bag. How many {item} is that?"
    return q, a * b, f"{a} bags of {b} make {_calc(f'{a} * {b}', a * b)} {item}."


def _div(r: random.Random, who: str, friend: str, item: str, hi: int) -> Problem:
    b = r.randint(2, min(9, hi))
    q = r.randint(1, hi // b)
    return (
        f"{who} shares {b * q} {item} equally among {b} friends. "
        f"How many {item} does each friend get?",
        q,
        f"Each friend gets {_calc(f'{b * q} / {b}', q)} {item}.",
    )


def _add_sub(r: random.Random, who: str, friend: str, item: str, hi: int) -> Problem:
    a, b = r.randint(1, hi), r.randint(1, hi)
    c = r.randint(1, min(hi, a + b - 1))
    return (
        f"{who} has {a} {item}, buys {b} more and then gives {c} to {friend}. "
        f"How many {item} does {who} have now?",
        a + b - c,
        f"After buying, {who} has {_calc(f'{a} + {b}', a + b)} {item}.\n"
        f"After giving some away, {who} has {_calc(f'{a + b} - {c}', a + b - c)} {item}.",
    )


def _sub_sub(r: random.Random, who: str, friend: str, item: str, hi: int) -> Problem:
    a = r.randint(3, hi)
    b = r.randint(1, a - 2)
    c = r.randint(1, a - b - 1)
    return (
        f"{who} has {a} {item}, loses {b} and gives {c} to {friend}. "
        f"How many {item} does {who} have left?",
        a - b - c,
        f"After losing some, {who} has {_calc(f'{a} - {b}', a - b)} {item}.\n"
        f"After giving some away, {who} has {_calc(f'{a - b} - {c}', a - b - c)} {item} left.",
    )


def _mul_add(r: random.Random, who: str, friend: str, item: str, hi: int) -> Problem:
    a, b, c = r.randint(2, min(9, hi)), r.randint(2, min(12, hi)), r.randint(1, hi)
    return (
        f"{who} has {a} boxes of {b} {item} and {c} more {item}. "
        f"How many {item} does {who} have in all?",
        a * b + c,
        f"The boxes hold {_calc(f'{a} * {b}', a * b)} {item}.\n"
        f"In all, {who} has {_calc(f'{a * b} + {c}', a * b + c)} {item}.",
    )


KINDS: dict[str, Callable[[random.Random, str, str, str, int], Problem]] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "div": _div,
    "add_sub": _add_sub,
    "sub_sub": _sub_sub,
    "mul_add": _mul_add,
}
"""Templates of ``word_problems`` (``kind``): four of one operation, three of two. A
template is ``(rng, name, friend's name, item, largest number) -> (question, answer, rationale)``;
factors stay at most 9 and 12 (a quotient's dividend at most the largest number)."""

SHAPES = ("chat", "gsm8k")
"""Row shapes of ``word_problems``: ``chat`` — ``{"id", "messages": [one user message:
the question and :data:`INSTRUCTION`], "answer": "12", "kind"}``; ``gsm8k`` — GSM8K's own
columns, ``{"question", "answer": "<rationale>\\n#### 12"}`` plus ``"id"`` and ``"kind"``,
read with ``taskset.prompt_template`` and ``taskset.answer_extract: gsm8k``."""


def _line(shape: str, id: str, question: str, answer: int, rationale: str, kind: str) -> dict:
    if shape == "gsm8k":
        return {
            "id": id,
            "question": question,
            "answer": f"{rationale}\n#### {answer}",
            "kind": kind,
        }
    return {
        "id": id,
        "messages": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
        "answer": str(answer),
        "kind": kind,
    }


MAX_NUMBER = 49
"""Default largest number written in a question ("numbers under 50")."""


def word_problems(
    n: int,
    seed: int,
    prefix: str = "wp",
    max_number: int = MAX_NUMBER,
    kinds: Sequence[str] | None = None,
    shape: str = "chat",
) -> list[dict]:
    """``n`` distinct word problems as taskset lines, the same for the same arguments:
    numbers from 1 to ``max_number``, templates ``kinds`` (default all of :data:`KINDS`),
    rows of ``shape`` (:data:`SHAPES`). The same seed draws the same problems in every
    shape."""
    if shape not in SHAPES:
        raise ConfigError(f"tasks: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    chosen = list(kinds or KINDS)
    unknown = [k for k in chosen if k not in KINDS]
    if unknown or max_number < 3:
        raise ConfigError(
            f"tasks: kinds must be among {', '.join(KINDS)} (got {', '.join(chosen)}) and "
            f"--max-number >= 3 (got {max_number})"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    lines: list[dict] = []
    for _ in range(100 * n + 1000):  # far more draws than distinct problems needed
        if len(lines) == n:
            break
        kind = rng.choice(chosen)
        who, friend = rng.sample(NAMES, 2)
        question, answer, rationale = KINDS[kind](rng, who, friend, rng.choice(ITEMS), max_number)
        if question in seen:
            continue
        seen.add(question)
        lines.append(_line(shape, f"{prefix}-{len(lines):05d}", question, answer, rationale, kind))
    if len(lines) < n:
        raise ConfigError(f"tasks: could not draw {n} distinct word problems")
    return lines


TASKSETS: dict[str, Callable[..., list[dict]]] = {"word_problems": word_problems}
"""Generators by ``streamrft tasks make`` name: ``(n, seed, id prefix, **options) -> lines``."""


def make_splits(
    name: str, n: int, eval_n: int, seed: int, **options: Any
) -> tuple[list[dict], list[dict]]:
    """Training and eval lines of generator ``name`` (``options``: its keyword arguments,
    e.g. ``max_number``, ``kinds``): one draw of ``n + eval_n`` distinct tasks, split so
    that no eval task is also a training task; ids ``<name>-train-00000``,
    ``<name>-eval-00000``."""
    if name not in TASKSETS:
        raise ConfigError(f"tasks: unknown task set {name!r}; known: {', '.join(TASKSETS)}")
    if n < 1 or eval_n < 0:
        raise ConfigError(f"tasks: --n must be >= 1 and --eval-n >= 0 (got {n}, {eval_n})")
    lines = TASKSETS[name](n + eval_n, seed, name, **options)
    for split, part in (("train", lines[:n]), ("eval", lines[n:])):
        for i, line in enumerate(part):
            line["id"] = f"{name}-{split}-{i:05d}"
    return lines[:n], lines[n:]


def eval_path_for(out: Path) -> Path:
    """Default eval file next to ``out``: ``tasks.jsonl`` -> ``tasks.eval.jsonl``."""
    return out.with_name(f"{out.stem}.eval{out.suffix or '.jsonl'}")


def write_rows(lines: list[dict], path: Path) -> Path:
    """Write ``lines`` as a Parquet file when ``path`` ends ``.parquet`` (needs
    ``pyarrow``), else one JSON object per line (folders created); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".parquet":
        path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
        return path
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            "tasks: writing Parquet needs pyarrow: pip install -e '.[data]'"
        ) from None
    pq.write_table(pa.Table.from_pylist(lines), path)
    return path
