"""Reward functions: ``(response text, task) -> (reward, info)``. Pure.

``explorer.reward`` names one: a key of :data:`REWARDS`, or a user function as
``"package.module:function"``, imported when the explorer starts. Adding a built-in reward is
a function here and a line in :data:`REWARDS`.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable

from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task

RewardFn = Callable[[str, Task], tuple[float, dict[str, float]]]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_MISSING = object()


def exact_match(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 when the response, stripped, equals the answer; else 0.0."""
    ok = response.strip() == task.answer.strip()
    return float(ok), {"correct": float(ok)}


def last_number(response: str, task: Task) -> tuple[float, dict[str, float]]:
    """1.0 when the last number in the response equals the answer numerically."""
    found = _NUMBER.findall(response)
    try:
        ok = bool(found) and float(found[-1]) == float(task.answer)
    except ValueError:
        ok = False
    return float(ok), {"correct": float(ok), "has_number": float(bool(found))}


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "last_number": last_number}
"""Built-in rewards by ``explorer.reward`` name."""


def get_reward(name: str) -> RewardFn:
    """The reward ``explorer.reward`` names: a registered name or ``"module:function"``."""
    if ":" in name:
        return _import_reward(name)
    try:
        return REWARDS[name]
    except KeyError:
        raise ConfigError(
            f"explorer.reward: unknown reward {name!r}; known: {', '.join(REWARDS)}, "
            "or a function as 'package.module:function'"
        ) from None


def _import_reward(path: str) -> RewardFn:
    """Import ``module:function``; every way it can fail is a ConfigError on explorer.reward."""
    module_name, _, attr = path.partition(":")
    if not _DOTTED.fullmatch(module_name) or not attr.isidentifier():
        raise ConfigError(f"explorer.reward: {path!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"explorer.reward: cannot import module {module_name!r} of {path!r}: {exc}"
        ) from exc
    fn = getattr(module, attr, _MISSING)
    if fn is _MISSING:
        raise ConfigError(f"explorer.reward: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(
            f"explorer.reward: {path!r} is a {type(fn).__name__}, not a function "
            "(response_text, task) -> (float, dict[str, float])"
        )
    _check_arity(path, fn)
    return fn


def _check_arity(path: str, fn: Callable) -> None:
    """A reward is called with two positional arguments: refuse one that cannot take them."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        signature.bind("", None)
    except TypeError as exc:
        raise ConfigError(
            f"explorer.reward: {path!r} cannot be called as (response_text, task): {exc}"
        ) from None
