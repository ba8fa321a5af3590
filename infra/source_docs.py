"""Docstrings of fields and classes, read from the source: the string literal after a
field is its documentation (as in ``infra/config.py``). The reference pages
(``tools/docgen.py``) and ``streamrft init --expert`` both read them here."""

from __future__ import annotations

import ast
import functools
import inspect
import types
from pathlib import Path

import msgspec


@functools.cache
def _module_ast(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(), filename=path)


def _class_node(cls: type) -> ast.ClassDef | None:
    path = inspect.getsourcefile(cls)
    if path is None:
        return None
    for node in _module_ast(path).body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


def _is_doc(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _attribute_docs(body: list[ast.stmt], grouped: bool) -> dict[str, str]:
    """Names assigned in ``body`` -> the string literal that follows them.

    ``grouped``: a string after a run of several fields describes every field of the run
    (since the previous string); otherwise it describes only the field directly above it.
    """
    docs: dict[str, str] = {}
    pending: list[str] = []
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pending.append(node.target.id)
        elif isinstance(node, ast.Assign):
            pending.extend(t.id for t in node.targets if isinstance(t, ast.Name))
        elif _is_doc(node) and pending:
            text = inspect.cleandoc(node.value.value)  # type: ignore[attr-defined]
            for name in pending if grouped else pending[-1:]:
                docs[name] = text
            pending = []
        else:
            pending = []
    return docs


def field_docs(cls: type, grouped: bool = False) -> dict[str, str]:
    """Field name -> description of a struct (own and inherited fields)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, msgspec.Struct):
            continue
        node = _class_node(klass)
        if node is not None:
            docs.update(_attribute_docs(node.body, grouped))
    return docs


def class_doc(cls: type) -> str:
    node = _class_node(cls)
    doc = ast.get_docstring(node) if node is not None else None
    return doc or ""


def module_docs(module: types.ModuleType) -> dict[str, str]:
    """Module-level constant -> the string literal that follows its assignment."""
    path = inspect.getsourcefile(module)
    return _attribute_docs(_module_ast(path).body, grouped=False) if path else {}
