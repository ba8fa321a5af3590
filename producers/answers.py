"""Reading the final answer out of a response, and comparing answers. Pure.

A response marks its answer with ``<answer>...</answer>`` tags or LaTeX ``\\boxed{...}``
(braces may nest); when it holds several, the last one counts. Two answers match when both
read as numbers equal within a relative tolerance (integers, decimals, fractions ``3/4``
or ``\\frac{3}{4}``, thousands separators ``1,234``, a leading ``$``, a trailing ``.``), else
when their normalized text is equal. A number longer than :data:`MAX_NUMBER_CHARS` is not
read as one (it is compared as text): a model can write thousands of digits, which neither
``float`` nor ``Fraction`` should be asked to hold.

``math-verify`` (symbolic LaTeX equivalence) is deliberately not a dependency: it pulls
an ANTLR runtime pinned to one version and a LaTeX-to-sympy parser, for answers (sets,
intervals, expressions) the tasks streamrft generates never have. A reward that needs it
can be a user function (``explorer.reward: package.module:function``).
"""

from __future__ import annotations

import re
from fractions import Fraction

from streamrft.infra.answer_extract import boxed_contents, last_boxed

REL_TOL = 1e-6
"""Relative tolerance of numeric equality."""
MAX_NUMBER_CHARS = 100
"""Longer text is never parsed as a number (:func:`parse_number` returns None)."""

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_GROUPED = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
# thousands groups first (``1,234.5``; not ``1,2345``, which is 1 and 2345), else plain digits
_LAST_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|-?\d+(?:\.\d+)?")


def tagged_contents(text: str) -> list[str]:
    """What every closed ``<answer>...</answer>`` pair of ``text`` holds, in order."""
    return _TAG.findall(text)


def extract_answer(text: str) -> str | None:
    """The last ``<answer>`` tag's content (unwrapping a ``\\boxed{}`` inside it), else the
    last ``\\boxed{}``'s, stripped; None when the response marks no answer."""
    tags = tagged_contents(text)
    if tags:
        inner = boxed_contents(tags[-1])
        return (inner[-1] if inner else tags[-1]).strip()
    return last_boxed(text)


def has_answer_format(text: str) -> bool:
    """Whether the response marks an answer (an ``<answer>`` pair or a ``\\boxed{}``)."""
    return extract_answer(text) is not None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (the fallback when no answer is marked), with
    its thousands separators (``1,234``) if it has them."""
    found = _LAST_NUMBER.findall(text)
    return found[-1] if found else None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number, or None when it is not one (or is longer than
    :data:`MAX_NUMBER_CHARS`)."""
    s = text.strip().removeprefix("\\$").removeprefix("$").rstrip(".").strip()
    if len(s) > MAX_NUMBER_CHARS:
        return None
    frac = _FRAC.fullmatch(s)
    if frac:
        s = f"{frac.group(1)}/{frac.group(2)}"
    if s.count("/") == 1:
        top, _, bottom = s.partition("/")
        num, den = parse_number(top), parse_number(bottom)
        return None if num is None or den is None or den == 0 else num / den
    if _GROUPED.fullmatch(s):
        s = s.replace(",", "")
    if not _PLAIN.fullmatch(s):
        return None
    return Fraction(s)


def normalize(text: str) -> str:
    """Lower case, single spaces, no surrounding ``$`` or trailing ``.``."""
    return " ".join(text.split()).strip("$").rstrip(".").strip().lower()


def answers_match(given: str, expected: str, rel_tol: float = REL_TOL) -> bool:
    """Numeric equality within ``rel_tol`` when both are numbers, else equal normalized text.
    The numbers are compared exactly as fractions (no ``float``, which overflows)."""
    a, b = parse_number(given), parse_number(expected)
    if a is not None and b is not None:
        return abs(a - b) <= Fraction(rel_tol) * max(abs(a), abs(b))
    return normalize(given) == normalize(expected)
