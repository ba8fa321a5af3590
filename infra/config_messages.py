"""What a config mistake is called when it is reported, and the YAML reading that
overrides need: the field's path, what the field expects, and the likely fix.

- an unknown field gets the nearest one: the same name in another section
  (``trainer.max_new_tokens`` -> ``explorer.max_new_tokens``), a name other frameworks use
  (``trainer.learning_rate`` -> ``trainer.lr``), or the closest spelling;
- a value outside a field's choices lists them (``model.dtype: 'bf16'`` -> ``bfloat16``);
- text that YAML reads as something else (``{question}`` is a mapping, ``2024`` a number)
  says how to quote it; in a ``-o key=value`` override it is taken as the text it is.

It knows the config's shape only through the root type it is given (``infra.config``
passes :class:`~streamrft.infra.config.Config`), so it imports nothing of the config.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import msgspec
import msgspec.inspect as mi

SYNONYMS: dict[str, str] = {
    "learning_rate": "lr",
    "optimizer_lr": "lr",
    "warmup_steps": "lr_warmup_steps",
    "lr_warmup_steps_ratio": "lr_warmup_ratio",
    "warmup_ratio": "lr_warmup_ratio",
    "lr_scheduler_type": "lr_schedule",
    "lr_scheduler": "lr_schedule",
    "max_response_tokens": "max_new_tokens",
    "max_response_length": "max_new_tokens",
    "response_length": "max_new_tokens",
    "max_tokens": "max_new_tokens",
    "max_prompt_length": "max_prompt_tokens",
    "max_prompt_len": "max_prompt_tokens",
    "n": "repeat_times",
    "rollout_n": "repeat_times",
    "num_generations": "repeat_times",
    "group_size": "repeat_times",
    "model_path": "path",
    "model_name_or_path": "path",
    "train_batch_size": "batch_size",
    "total_training_steps": "max_steps",
    "total_steps": "max_steps",
    "epochs": "total_epochs",
    "kl_coef": "kl_loss_coef",
    "algorithm_type": "type",
    "save_freq": "save_interval",
    "gpu_memory_utilisation": "gpu_memory_utilization",
}
"""Names other frameworks (Trinity-RFT, verl, TRL) give a field, -> streamrft's name."""

_KINDS: dict[type, str] = {
    dict: "a mapping",
    list: "a list",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "empty (null)",
}


def _unwrap(t: mi.Type) -> mi.Type:
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _members(t: mi.Type) -> list[mi.Type]:
    t = _unwrap(t)
    return [_unwrap(m) for m in t.types] if isinstance(t, mi.UnionType) else [t]


def _struct(t: mi.Type) -> mi.StructType | None:
    return next((m for m in _members(t) if isinstance(m, mi.StructType)), None)


def _item(t: mi.Type) -> mi.Type | None:
    kinds = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)
    return next((m.item_type for m in _members(t) if isinstance(m, kinds)), None)


def field_type(root: type, path: list[str]) -> mi.Type | None:
    """The type of the field at ``path`` (``["taskset", "sources", "0", "path"]``: list
    items by index) under ``root``; None where no such field is."""
    t: mi.Type | None = mi.type_info(root)
    for key in path:
        if t is None:
            return None
        if key.isdigit():
            t = _item(t)
            continue
        struct = _struct(t)
        found = next((f for f in struct.fields if f.name == key), None) if struct else None
        t = found.type if found else None
    return t


def _fields(root: type) -> dict[str, list[str]]:
    """Every section of ``root`` -> its field names (the top level under "")."""
    top = mi.type_info(root)
    assert isinstance(top, mi.StructType)
    out = {"": [f.name for f in top.fields]}
    for f in top.fields:
        struct = _struct(f.type)
        if struct is not None:
            out[f.name] = [g.name for g in struct.fields]
    return out


def nearest_field(root: type, section: str, name: str) -> str | None:
    """The dotted field a mistaken ``section.name`` most likely means, else None."""
    fields = _fields(root)
    own = fields.get(section, [])
    wanted = SYNONYMS.get(name, name)
    if wanted != name and wanted in own:
        return _dotted(section, wanted)
    elsewhere = [s for s, names in fields.items() if s and s != section and wanted in names]
    if elsewhere and section:
        return _dotted(elsewhere[0], wanted)
    close = difflib.get_close_matches(name, own, n=1, cutoff=0.6)
    if close:
        return _dotted(section, close[0])
    if not section:
        return None
    every = [_dotted(s, n) for s, names in fields.items() if s for n in names]
    close = difflib.get_close_matches(name, [e.split(".", 1)[1] for e in every], n=1, cutoff=0.75)
    return next(e for e in every if e.endswith("." + close[0])) if close else None


def _dotted(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def _takes_text(t: mi.Type) -> bool:
    return any(isinstance(m, mi.StrType) for m in _members(t))


def _admits(t: mi.Type, value: Any) -> bool:
    """Whether a field of type ``t`` could take ``value`` as YAML read it."""
    kinds: dict[type, tuple[type, ...]] = {
        dict: (mi.DictType, mi.StructType, mi.AnyType),
        list: (mi.ListType, mi.VarTupleType, mi.TupleType, mi.SetType, mi.AnyType),
        bool: (mi.BoolType, mi.AnyType),
        int: (mi.IntType, mi.FloatType, mi.AnyType),
        float: (mi.FloatType, mi.AnyType),
        type(None): (mi.NoneType, mi.AnyType),
        str: (mi.StrType, mi.LiteralType, mi.AnyType),
    }
    wanted = kinds.get(type(value), (mi.AnyType,))
    return any(isinstance(m, wanted) for m in _members(t))


def override_value(root: type, keys: list[str], raw: str, value: Any) -> Any:
    """The value of ``-o key=value``: as YAML read it, except where the field takes text
    and YAML read something it cannot take (``{question}`` a mapping): then the text."""
    t = field_type(root, keys)
    if t is None or isinstance(value, str) or not _takes_text(t) or _admits(t, value):
        return value
    return raw.strip()


_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>[^`]*)`")
_ENUM = re.compile(r"Invalid enum value (?P<value>.+)$")
_EXPECTED = re.compile(r"Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)`")


def explain(root: type, path: str, reason: str, data: dict[str, Any]) -> str:
    """``path: reason`` of a failed conversion of config tree ``data`` (``path`` dotted,
    list items as ``[i]``; "" at the top), with the hint the mistake calls for."""
    keys = [k for k in re.split(r"\.|\[(\d+)\]", path) if k]
    m = _UNKNOWN.search(reason)
    if m:
        name = m.group("name")
        if len(keys) <= 1:
            near = nearest_field(root, keys[0] if keys else "", name)
        else:
            struct = _struct(field_type(root, keys) or mi.AnyType())
            names = [f.name for f in struct.fields] if struct else []
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            near = _dotted(path, close[0]) if close else None
        hint = f"; did you mean {near}?" if near else ""
        return f"{path or 'config'}: unknown field `{name}`{hint}"
    t = field_type(root, keys)
    m = _ENUM.search(reason)
    if m and t is not None:
        choices = [
            str(v) for m_ in _members(t) if isinstance(m_, mi.LiteralType) for v in m_.values
        ]
        given = m.group("value").strip("'\"")
        close = difflib.get_close_matches(given, choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{path}: {reason}; expected one of {', '.join(choices)}{hint}"
    m = _EXPECTED.search(reason)
    value = _at(data, keys)
    if m and t is not None and _takes_text(t) and not isinstance(value, str):
        kind = _KINDS.get(type(value), f"a {type(value).__name__}")
        shown = _as_written(value)
        key = f"{keys[-1]}: " if keys and not keys[-1].isdigit() else ""
        flag = f" (on the command line: -o '{path}=\"{shown}\"')" if "[" not in path else ""
        return (
            f"{path}: expected text, but YAML read {shown} as {kind}; quote it: "
            f'{key}"{shown}"{flag}'
        )
    return f"{path or 'config'}: {reason}"


def _at(data: Any, keys: list[str]) -> Any:
    for key in keys:
        if isinstance(data, list) and key.isdigit() and int(key) < len(data):
            data = data[int(key)]
        elif isinstance(data, dict) and key in data:
            data = data[key]
        else:
            return None
    return data


def _as_written(value: Any) -> str:
    """A value as it was likely written unquoted: ``{question}`` for ``{question: null}``."""
    if isinstance(value, dict) and all(v is None for v in value.values()):
        return "{" + ", ".join(map(str, value)) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return msgspec.json.encode(value).decode() if isinstance(value, dict | list) else str(value)
