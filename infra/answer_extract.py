"""Reading a reference answer out of a dataset's answer field (``taskset.answer_extract``),
and the marked parts of a text both the taskset and the rewards read. Pure.

GSM8K's ``answer`` is a rationale ending ``#### 72``; MATH's solutions hold the answer in
``\\boxed{...}``; other sets need a regular expression. A named extractor or a pattern
with one group turns the field into the answer a reward compares with.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from streamrft.schemas.errors import ConfigError

_BOXED = "\\boxed{"
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL | re.IGNORECASE)


def boxed_contents(text: str) -> list[str]:
    """What every balanced ``\\boxed{...}`` of ``text`` holds, in order (nested braces
    kept; an unclosed one is skipped)."""
    found = []
    start = text.find(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append(text[start + len(_BOXED) : i - 1])
        start = text.find(_BOXED, start + 1)
    return found


def without_thinking(text: str) -> str:
    """``text`` without its ``<think>...</think>`` segments (a reasoning model's scratch
    work); a segment never closed runs to the end (the model was cut off thinking)."""
    return _THINK.sub("", text)


def gsm8k_answer(text: str) -> str | None:
    """What follows the last ``####`` (GSM8K's final-answer marker), without thousands
    separators; None without a marker."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}``'s content, stripped; None without one."""
    found = boxed_contents(text)
    return found[-1].strip() if found else None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "gsm8k": gsm8k_answer,
    "boxed": last_boxed,
}
"""``taskset.answer_extract`` names; anything else is a regular expression."""


def answer_extractor(spec: str) -> Callable[[str], str | None]:
    """The extractor ``spec`` names, or a regular expression with one group (its first
    match's group, stripped); a :class:`ConfigError` for a pattern that does not compile or
    does not have exactly one group."""
    if spec in EXTRACTORS:
        return EXTRACTORS[spec]
    try:
        pattern = re.compile(spec, re.DOTALL)
    except re.error as exc:
        raise ConfigError(
            f"taskset.answer_extract: {spec!r} is not a regular expression: {exc}"
        ) from None
    if pattern.groups != 1:
        raise ConfigError(
            f"taskset.answer_extract: {spec!r} has {pattern.groups} groups; give one group "
            f"(the answer), or a name: {', '.join(EXTRACTORS)}"
        )

    def by_pattern(text: str) -> str | None:
        match = pattern.search(text)
        return match.group(1).strip() if match and match.group(1) is not None else None

    return by_pattern
