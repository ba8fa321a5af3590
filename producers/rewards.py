"""Reward functions: ``(response text, task) -> (reward, info)``. Pure, but for the reward
services (``judge``, ``code_tests``: :data:`SERVICES`), whose I/O lives in their own modules.

``explorer.reward`` names one: a key of :data:`REWARDS`, or a user function as
``"package.module:function"``, imported when the explorer starts. Adding a built-in reward is
a function here and a line in :data:`REWARDS`. The rewards that read an answer out of
the response (``last_number``, ``math_answer``, ``format``, ``math_answer_format``) never
read it inside a ``<think>...</think>`` segment (a reasoning model's scratch work, a
segment never closed running to the end) unless ``explorer.reward_skips_thinking`` is off;
``exact_match`` compares the whole response.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Sequence

from streamrft.infra.answer_extract import without_thinking
from streamrft.infra.config import RewardConfig
from streamrft.producers import answers
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task

RewardFn = Callable[[str, Task], tuple[float, dict[str, float]]]

_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_MISSING = object()


def exact_match(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 when the response, stripped, equals the answer; else 0.0."""
    ok = response.strip() == task.answer.strip()
    return float(ok), {"correct": float(ok)}


def _skips_thinking(fn: RewardFn) -> RewardFn:
    """``fn`` given the response without its ``<think>`` segments; ``fn`` itself, reading
    the whole response, stays reachable as the result's ``whole_response``."""

    @functools.wraps(fn)
    def reward(response: str, task: Task) -> tuple[float, dict[str, float]]:
        return fn(without_thinking(response), task)

    reward.whole_response = fn  # type: ignore[attr-defined]
    return reward


@_skips_thinking
def last_number(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 when the last number in the response (``1,234`` read as 1234) matches the answer
    (:func:`~streamrft.producers.answers.answers_match`: numerically when both are numbers)."""
    found = answers.last_number(response)
    ok = found is not None and answers.answers_match(found, task.answer)
    return float(ok), {"correct": float(ok), "has_number": float(found is not None)}


@_skips_thinking
def math_answer(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 when the response's answer matches the task's: the answer marked with
    ``<answer>`` tags or ``\\boxed{}`` (the last one), else the last number written,
    compared numerically (relative tolerance 1e-6; fractions, ``1,234``, ``$12``) or as
    normalized text (:mod:`~streamrft.producers.answers`)."""
    marked = answers.extract_answer(response)
    given = marked if marked is not None else answers.last_number(response)
    ok = given is not None and answers.answers_match(given, task.answer)
    return float(ok), {"correct": float(ok), "format": float(marked is not None)}


@_skips_thinking
def answer_format(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 when the response marks an answer (an ``<answer>...</answer>`` pair or a
    ``\\boxed{...}``), right or wrong; else 0.0."""
    ok = answers.has_answer_format(response)
    return float(ok), {"format": float(ok)}


MATH_ANSWER_WEIGHT = 0.9
"""Share of ``math_answer_format`` given for a correct answer; the rest is for the format."""


@_skips_thinking
def math_answer_format(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """``0.9 * math_answer + 0.1 * format``: a right answer counts most, marking it
    (``<answer>`` tags or ``\\boxed{}``) earns a little on its own, which a small model
    learns first."""
    correct, info = math_answer.whole_response(response, task)  # type: ignore[attr-defined]
    value = MATH_ANSWER_WEIGHT * correct + (1 - MATH_ANSWER_WEIGHT) * info["format"]
    return value, info


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "last_number": last_number,
    "math_answer": math_answer,
    "format": answer_format,
    "math_answer_format": math_answer_format,
}
"""Built-in rewards by ``explorer.reward`` name."""


def _judge(service: RewardConfig) -> RewardFn:
    from streamrft.producers.reward_judge import JudgeReward

    return JudgeReward(service)


def _code_tests(service: RewardConfig) -> RewardFn:
    from streamrft.producers.reward_sandbox import CodeTestsReward

    return CodeTestsReward(
        service.sandbox, service.concurrency, service.cache_size, service.timeout_s
    )


SERVICES: dict[str, Callable[[RewardConfig], RewardFn]] = {
    "judge": _judge,
    "code_tests": _code_tests,
}
"""Rewards scored by a service (I/O, set under ``reward``), by ``explorer.reward`` name."""


def get_reward(
    name: str, skips_thinking: bool = True, service: RewardConfig | None = None
) -> RewardFn:
    """The reward ``explorer.reward`` names: a registered name, a reward service (its
    settings: ``service``, the ``reward`` section) or ``"module:function"``; a built-in
    answer reader reads the whole response when not ``skips_thinking``
    (``explorer.reward_skips_thinking``)."""
    if ":" in name:
        return _import_reward(name)
    if name in SERVICES:
        return SERVICES[name](service or RewardConfig())
    try:
        fn = REWARDS[name]
    except KeyError:
        raise ConfigError(
            f"explorer.reward: unknown reward {name!r}; known: {', '.join(REWARDS)}, "
            f"{', '.join(SERVICES)}, or a function as 'package.module:function'"
        ) from None
    return fn if skips_thinking else getattr(fn, "whole_response", fn)


def score_all(reward: RewardFn, pairs: Sequence[tuple[str, Task]]) -> list[tuple[float, dict]]:
    """``reward`` of each (response, task): at once where the reward is a service that
    scores many together (``score_all``), else one by one."""
    many = getattr(reward, "score_all", None)
    if many is not None:
        return many(pairs)
    return [reward(response, task) for response, task in pairs]


def _import_reward(path: str) -> RewardFn:
    """Import ``module:function``; every way it can fail is a ConfigError on explorer.reward."""
    return import_function(
        path, "explorer.reward", ("response_text", "task"), "-> (float, dict[str, float])"
    )


def import_function(path: str, field: str, params: tuple[str, ...], returns: str) -> Callable:
    """The function ``"package.module:function"`` names, callable with ``params``
    (positional); every way it can fail is a ConfigError naming ``field``."""
    module_name, _, attr = path.partition(":")
    shape = f"({', '.join(params)}) {returns}"
    if not _DOTTED.fullmatch(module_name) or not attr.isidentifier():
        raise ConfigError(f"{field}: {path!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{field}: cannot import module {module_name!r} of {path!r}: {exc}"
        ) from exc
    fn = getattr(module, attr, _MISSING)
    if fn is _MISSING:
        raise ConfigError(f"{field}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{field}: {path!r} is a {type(fn).__name__}, not a function {shape}")
    _check_arity(path, fn, field, params)
    return fn


def _check_arity(path: str, fn: Callable, field: str, params: tuple[str, ...]) -> None:
    """Refuse a function that cannot take ``params`` as positional arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        signature.bind(*params)
    except TypeError as exc:
        raise ConfigError(
            f"{field}: {path!r} cannot be called as ({', '.join(params)}): {exc}"
        ) from None
