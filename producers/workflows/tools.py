"""The local tools of the ``tool_calling`` workflow and how a policy's text calls them. Pure.

Two tools, each taking one string argument and returning a string (an error is a string
too, ``error: ...``: a bad call is the policy's mistake, shown to it as the tool's result,
never an exception):

- ``calculator(expression)``: arithmetic on numbers with ``+ - * /`` and parentheses,
  parsed with :mod:`ast` and evaluated node by node (never ``eval``): anything else
  (names, calls, attributes, ``**``) is refused.
- ``lookup(key)``: the value of ``key`` in the task's table, ``task.metadata["lookup"]``
  as a JSON object of strings (``{"paris": "france"}``).

A call is written in the plain-text format ``<tool>NAME(ARGUMENT)</tool>`` (what a model
whose chat template takes no tools is told, or taught) or in the Hermes format that
tool-aware chat templates (Qwen2.5, Qwen3, Hermes) ask for:
``<tool_call>{"name": NAME, "arguments": {"expression": ARGUMENT}}</tool_call>``.
:func:`parse_call` reads the first call of either format in a turn.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

LOOKUP_KEY = "lookup"
"""The task metadata key of the ``lookup`` tool's table (a JSON object of strings)."""

MAX_EXPRESSION = 200
"""Longest expression the calculator reads (characters)."""
MAX_MAGNITUDE = 1e15
"""Largest absolute value the calculator computes with (beyond: an error)."""

TOOL_SCHEMAS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic with numbers, + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 2+3*4"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up in the task's table.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "description": "the key"}},
                "required": ["key"],
            },
        },
    },
]
"""The tools as JSON schemas (the ``tools`` of ``apply_chat_template``)."""

_PLAIN = re.compile(r"<tool>\s*([A-Za-z_]\w*)\s*\((.*?)\)\s*</tool>", re.DOTALL)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str

    def __str__(self) -> str:
        return f"{self.name}({self.argument})"


def parse_call(text: str) -> ToolCall | None:
    """The first tool call in a policy turn (plain or Hermes format), or None: a final
    answer. A Hermes call whose JSON is broken is a call of the tool ``invalid``."""
    plain, hermes = _PLAIN.search(text), _HERMES.search(text)
    if plain and (not hermes or plain.start() < hermes.start()):
        return ToolCall(plain.group(1), plain.group(2).strip())
    if not hermes:
        return None
    try:
        body = json.loads(hermes.group(1).strip())
        args = body.get("arguments") or {}
        argument = next(iter(args.values()), "") if isinstance(args, dict) else args
        return ToolCall(str(body["name"]), str(argument))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ToolCall("invalid", hermes.group(1).strip())


def _number(node: ast.AST) -> float:
    """The value of an arithmetic node; ValueError for anything that is not one."""
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        value = float(node.value)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_number(node.left), _number(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_number(node.operand))
    else:
        raise ValueError(f"only numbers, + - * / and parentheses, not {type(node).__name__}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("number too large")
    return value


def _show(value: float) -> str:
    """An integral value without ``.0``; others as Python writes them, rounded to 1e-9."""
    return str(int(value)) if value.is_integer() else repr(round(value, 9))


def calculator(expression: str, table: Mapping[str, str] | None = None) -> str:
    """The value of ``expression``, or ``error: ...`` (never an exception)."""
    if len(expression) > MAX_EXPRESSION:
        return f"error: expression longer than {MAX_EXPRESSION} characters"
    try:
        return _show(_number(ast.parse(expression.strip(), mode="eval").body))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, OverflowError, RecursionError) as exc:
        return f"error: {exc.msg if isinstance(exc, SyntaxError) else exc}"


def lookup(key: str, table: Mapping[str, str] | None = None) -> str:
    """``table[key]``, or ``error: ...`` for a key it does not hold."""
    key = key.strip().strip("'\"")
    if table is None or key not in table:
        return f"error: no entry {key[:40]!r}"
    return table[key]


TOOLS: dict[str, Callable[[str, Mapping[str, str] | None], str]] = {
    "calculator": calculator,
    "lookup": lookup,
}
"""Tool name -> function ``(argument, the task's lookup table) -> result text``."""


def lookup_table(metadata: Mapping[str, str]) -> dict[str, str] | None:
    """The task's ``lookup`` table, or None when it has none or it is not a JSON object
    of strings."""
    try:
        table = json.loads(metadata.get(LOOKUP_KEY, "null"))
    except ValueError:
        return None
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        return None
    return table


def run_call(call: ToolCall, table: Mapping[str, str] | None) -> str:
    """The result of ``call`` (``error: ...`` for an unknown tool)."""
    tool = TOOLS.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name[:40]!r}; known: {', '.join(TOOLS)}"
    return tool(call.argument, table)


def plain_instructions(schemas: list[dict]) -> str:
    """How to call ``schemas``' tools in the plain-text format (a system message for a
    chat model whose template takes no tools)."""
    lines = [
        f"- {s['function']['name']}({next(iter(s['function']['parameters']['properties']))})"
        f": {s['function']['description']}"
        for s in schemas
    ]
    return (
        "You can call a tool by writing <tool>NAME(ARGUMENT)</tool>; its result comes back "
        "in the next message. Tools:\n" + "\n".join(lines) + "\nWrite your final answer "
        "without a tool call."
    )
