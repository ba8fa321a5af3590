"""A config of another framework as streamrft fields: the machinery of the converters.

A converter (:mod:`.convert_trinity`, :mod:`.convert_verl`) is a table of :class:`Rule`
(a source key, the streamrft field it becomes, how its value maps, what the reader should
know), a table of :class:`Default` (a default of the source that differs from
streamrft's: written explicitly, with both said) and a few functions for what one key
cannot say alone. :func:`apply` runs the tables over the source's keys, flattened to
dotted paths (:func:`flatten`); what no rule takes goes to :attr:`Conversion.unmapped`.
Everything here is pure: reading the source and writing the config is
:mod:`.init_from`'s.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrft.infra.config import Config


@dataclass
class Conversion:
    """What a source config became: streamrft fields with the reasons of each, the source
    keys with no counterpart, and notes on the whole."""

    source: str
    """The source framework's name as the comments say it (``Trinity-RFT``, ``verl``)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """``section.field`` -> value (a nested section's field holds a mapping)."""
    reasons: dict[str, list[str]] = field(default_factory=dict)
    """``section.field`` -> why it holds its value, one line per decision."""
    unmapped: dict[str, str] = field(default_factory=dict)
    """Source key (``a.b.c``, a list item as ``a.b[1].c``) -> why it has no counterpart."""
    notes: list[str] = field(default_factory=list)
    """What applies to the whole config (how to run it, what to fetch first)."""
    eval_split: str | None = None
    """The split the evaluation set is read from in the source, where it differs from the
    training set's (a folder's files of that split are taken by the writer)."""

    def set(self, target: str, value: Any, why: str) -> None:
        """``target`` holds ``value`` because ``why`` (a later ``set`` replaces the value
        and adds its reason)."""
        self.fields[target] = value
        self.reasons.setdefault(target, []).append(why)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def skip(self, key: str, why: str) -> None:
        self.unmapped[key] = why

    def tree(self) -> dict[str, dict[str, Any]]:
        """The fields as a config tree, ``{section: {field: value}}``."""
        out: dict[str, dict[str, Any]] = {}
        for target, value in self.fields.items():
            section, name = target.split(".", 1)
            out.setdefault(section, {})[name] = value
        return out

    def reason_text(self) -> dict[str, str]:
        """Each field's reasons as one line (what ``init``'s writer puts above it)."""
        return {target: "; ".join(why) for target, why in self.reasons.items()}


@dataclass(frozen=True)
class Rule:
    """A source key and the streamrft field it becomes."""

    key: str
    """The source key, dotted (``synchronizer.sync_offset``)."""
    target: str
    """The streamrft field, ``section.field``."""
    values: Mapping[Any, Any] | Callable[[Any], Any] | None = None
    """How a value maps: None, as it is; a mapping, by value (text compared without case;
    a value it lacks has no counterpart); a function of the value."""
    why: str = ""
    """What differs, for the comment above the field."""
    value_why: Mapping[str, str] = field(default_factory=dict)
    """More to say of some values (by the source's value, lower case)."""


@dataclass(frozen=True)
class Default:
    """A default of the source that differs from streamrft's, for when its key is left out."""

    key: str
    """The source key whose absence means the source's default."""
    theirs: Any
    """The source's default."""
    target: str
    """The streamrft field of the same meaning."""
    take: bool = False
    """Write the source's value: where streamrft's default is the tiny model's (a learning
    rate, a precision). Otherwise streamrft's own value is written, and the comment says
    how to match."""
    why: str = ""
    said: str = ""
    """The source's default as the comment says it, where :attr:`theirs` is its value in
    streamrft's terms (``sequential`` for ``false``)."""
    advice: str = ""
    """What to do in place of "set to X to match", where X would not do here."""


def streamrft_default(target: str) -> Any:
    """The default of streamrft's field ``section.field`` (nested: ``a.b.c``)."""
    value: Any = Config()
    for part in target.split("."):
        value = getattr(value, part)
    return msgspec.to_builtins(value)


def shown(value: Any) -> str:
    """A value as the comments write it: ``1e-06``, ``true``, ``null``, ``[a, b]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{dotted key: leaf}``; lists and empty mappings are leaves."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def mapped(rule: Rule, value: Any) -> tuple[bool, Any]:
    """``(True, streamrft value)`` of ``value`` under ``rule``, or ``(False, None)`` where
    the value has no counterpart."""
    if rule.values is None:
        return True, value
    if callable(rule.values):
        return True, rule.values(value)
    table = rule.values
    probe = value.lower() if isinstance(value, str) else value
    for known, ours in table.items():
        if (known.lower() if isinstance(known, str) else known) == probe:
            return True, ours
    return False, None


def apply(
    flat: dict[str, Any], rules: Iterable[Rule], defaults: Iterable[Default], conv: Conversion
) -> None:
    """Every rule over the source keys ``flat`` (each key taken is removed from it), then
    every default whose key is absent and whose field no rule set. What is left of ``flat``
    is the caller's: its own functions' keys, and then :func:`leftovers`."""
    taken: set[str] = set()
    nulls = {key for key, value in flat.items() if value is None}
    for rule in rules:
        if rule.key not in flat:
            continue
        value = flat[rule.key]
        taken.add(rule.key)
        if value is None:  # YAML's null, Hydra's null: the source's default, said below
            continue
        ok, ours = mapped(rule, value)
        if not ok:
            known = ", ".join(map(shown, rule.values)) if isinstance(rule.values, Mapping) else ""
            conv.skip(rule.key, f"{shown(value)} has no counterpart (mapped: {known})")
            continue
        said = [f"{conv.source}'s `{rule.key}: {shown(value)}`", rule.why]
        said.append(rule.value_why.get(str(value).lower(), ""))
        conv.set(rule.target, ours, "; ".join(s for s in said if s))
    for key in taken:
        del flat[key]
    for d in defaults:
        given = d.key in flat or d.key in conv.unmapped or (d.key in taken and d.key not in nulls)
        if given or d.target in conv.fields or d.theirs == streamrft_default(d.target):
            continue
        explicit_default(conv, d)


def drop_same(flat: dict[str, Any], same: Mapping[str, tuple[Any, ...]]) -> None:
    """Take the keys of ``flat`` whose value is one of ``same``'s for the key: what
    streamrft does anyway, no field needed."""
    for key, values in same.items():
        if key in flat and flat[key] in values:
            del flat[key]


def finish(
    flat: dict[str, Any],
    conv: Conversion,
    steps_key: str,
    same: Mapping[str, tuple[Any, ...]],
    known: Mapping[str, str],
) -> None:
    """The end of a conversion: a run until its epochs end where the source's
    ``steps_key`` set no length, the keys ``same`` takes, the rest unmapped (their reasons
    from ``known``, :func:`leftovers`), then :func:`settle`."""
    if "trainer.max_steps" not in conv.fields:
        conv.set(
            "trainer.max_steps",
            0,
            f"`{steps_key}` not set: {conv.source} runs until its epochs end; 0 does too",
        )
    drop_same(flat, same)
    leftovers(flat, conv, known)
    settle(conv)


def explicit_default(conv: Conversion, d: Default) -> None:
    """``d``'s field written with the value :attr:`Default.take` chooses, both defaults said."""
    ours = streamrft_default(d.target)
    said = f"{conv.source}'s default is {d.said or shown(d.theirs)}, streamrft's is {shown(ours)}"
    if d.take:
        text = f"{said}: {shown(d.theirs)} written, as the {conv.source} run had it"
    elif d.advice:
        text = f"{said}: {d.advice}"
    else:
        text = f"{said}: set to {shown(d.theirs)} to match"
    if d.why:
        text += f" ({d.why})"
    conv.set(d.target, d.theirs if d.take else ours, f"`{d.key}` not set: {text}")


def leftovers(
    flat: Mapping[str, Any], conv: Conversion, known: Mapping[str, str], prefix: str = ""
) -> None:
    """Each key of ``flat`` no rule took, as unmapped (named ``prefix`` + key): with its
    reason from ``known`` (by key, or by the longest of its prefixes there, each ending
    at a dot or a ``*``), else "no counterpart"."""
    for key, value in flat.items():
        if value is None:  # null: the source's default
            continue
        why = known.get(key)
        if why is None:
            prefixes = [p for p in known if p[-1:] in ".*" and key.startswith(p.rstrip("*"))]
            why = known[max(prefixes, key=len)] if prefixes else "no counterpart in streamrft"
        conv.skip(prefix + key, f"{shown(value)}: {why}")


_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")
_REF = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
_EXPONENT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


def interpolate(data: Any, env: Mapping[str, str], root: Mapping[str, Any] | None = None) -> Any:
    """``data`` with OmegaConf's ``${oc.env:VAR,default}`` and ``${a.b}`` filled from
    ``env`` and from ``data`` itself (one level; what cannot be filled stays as written),
    and numbers YAML 1.1 reads as text (``1e-5``) as numbers, as OmegaConf reads them."""
    root = data if root is None else root
    if isinstance(data, Mapping):
        return {k: interpolate(v, env, root) for k, v in data.items()}
    if isinstance(data, list):
        return [interpolate(v, env, root) for v in data]
    if not isinstance(data, str):
        return data
    whole = _REF.fullmatch(data)
    if whole:  # a reference alone keeps the referenced value's type
        found = _lookup(root, whole.group(1))
        return data if found is None else found
    text = _ENV.sub(lambda m: env.get(m.group(1), (m.group(2) or "").strip(" '\"")), data)
    text = _REF.sub(lambda m: _text(_lookup(root, m.group(1)), m.group(0)), text)
    return float(text) if _EXPONENT.fullmatch(text) else text


def _lookup(root: Mapping[str, Any], dotted: str) -> Any:
    value: Any = root
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _text(value: Any, otherwise: str) -> str:
    return otherwise if value is None or isinstance(value, Mapping | list) else str(value)


def hub_name(path: str) -> str | None:
    """The hub repository ``path`` may name (``openai/gsm8k`` of ``openai/gsm8k/main``):
    its first two names, where it is relative and they read as ``owner/name``."""
    parts = path.split("/")
    if len(parts) < 2 or path.startswith((".", "~")) or parts[1].endswith(DATA_SUFFIXES):
        return None
    found = "/".join(parts[:2])
    return found if re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", found) else None


DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".arrow", ".txt")


def run_name(text: str) -> str:
    """``text`` as a valid ``run.name`` (letters, digits, ``_`` and ``-``)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "run"


def comment_block(conv: Conversion, width: int = 88) -> list[str]:
    """The comment lines that end the written file: the notes, and each key with no
    counterpart with its reason (lines wrapped at ``width``)."""
    lines = []
    if conv.notes:
        lines += ["", f"# From {conv.source}: notes"]
        for note in conv.notes:
            lines += textwrap.wrap(note, width, initial_indent="#   - ", subsequent_indent="#     ")
    if conv.unmapped:
        lines += ["", f"# {conv.source} keys with no streamrft counterpart (not converted):"]
        for key, why in conv.unmapped.items():
            text = f"{key}: {why}"
            lines += textwrap.wrap(text, width, initial_indent="#   ", subsequent_indent="#       ")
    return lines


SCHEDULES = {"constant": "constant", "cosine": "cosine"}
"""verl's learning-rate schedules (Trinity-RFT trains through verl)."""


def optimizer_rules(prefix: str) -> list[Rule]:
    """verl's optimizer block (``actor.optim``; Trinity-RFT's ``algorithm.optimizer``
    mirrors it) at ``prefix``."""
    return [
        Rule(f"{prefix}.lr", "trainer.lr"),
        Rule(f"{prefix}.weight_decay", "trainer.weight_decay"),
        Rule(f"{prefix}.betas", "trainer.betas", list),
        Rule(f"{prefix}.clip_grad", "trainer.grad_clip"),
        Rule(f"{prefix}.min_lr_ratio", "trainer.min_lr_ratio"),
        Rule(
            f"{prefix}.lr_warmup_steps",
            "trainer.lr_warmup_steps",
            lambda v: max(int(v), 0),
            value_why={"-1": "no warm-up of its own (the ratio decides)"},
        ),
        Rule(f"{prefix}.lr_warmup_steps_ratio", "trainer.lr_warmup_ratio"),
        Rule(f"{prefix}.lr_scheduler_type", "trainer.lr_schedule", SCHEDULES),
        Rule(
            f"{prefix}.warmup_style",
            "trainer.lr_schedule",
            SCHEDULES,
            "lr_scheduler_type's old name",
        ),
    ]


def optimizer_defaults(prefix: str, weight_decay: float, min_lr_ratio: float) -> list[Default]:
    """The optimizer's defaults that differ from streamrft's (the source's own
    ``weight_decay`` and ``min_lr_ratio``)."""
    return [
        Default(
            f"{prefix}.lr", 1e-6, "trainer.lr", take=True, why="streamrft's is the tiny model's"
        ),
        Default(f"{prefix}.weight_decay", weight_decay, "trainer.weight_decay", why="AdamW's"),
        Default(
            f"{prefix}.min_lr_ratio",
            min_lr_ratio,
            "trainer.min_lr_ratio",
            why="the floor of a cosine decay, as a share of lr",
        ),
    ]


def settle(conv: Conversion) -> None:
    """What the fields say together, made consistent as streamrft's config checks want:
    a model folder's source, one warm-up, the steps a schedule decays over, the staleness
    the sync schedule needs, an engine that splits a model over GPUs, groups of 2 or more."""
    f = conv.fields
    if f.get("model.path"):
        conv.set("model.source", "path", "a model folder")
    if f.get("trainer.lr_warmup_steps") and f.get("trainer.lr_warmup_ratio"):
        del f["trainer.lr_warmup_ratio"], conv.reasons["trainer.lr_warmup_ratio"]
        conv.reasons["trainer.lr_warmup_steps"].append(f"{conv.source} takes it over the ratio")
    if f.get("trainer.max_steps") == 0 and (
        f.get("trainer.lr_schedule", "constant") != "constant" or f.get("trainer.lr_warmup_ratio")
    ):
        steps = streamrft_default("trainer.max_steps")
        conv.set(
            "trainer.max_steps",
            steps,
            f"the schedule decays (or warms up) over the run's steps, which {conv.source} "
            f"counts from the epochs: set the run's steps (epochs x tasks / batch); {steps} "
            "until then",
        )
    sync = {k: f.get(f"synchronizer.{k}", streamrft_default(f"synchronizer.{k}"))
            for k in ("sync_offset", "sync_interval")}  # fmt: skip
    needed = sync["sync_offset"] + sync["sync_interval"] - 1
    if needed > f.get("trainer.max_staleness", streamrft_default("trainer.max_staleness")):
        conv.set(
            "trainer.max_staleness",
            needed,
            f"sync_offset {sync['sync_offset']} + sync_interval {sync['sync_interval']} - 1: "
            "the oldest version a batch may be sampled with",
        )
    tp = f.get("explorer.tensor_parallel_size", 1)
    if tp > 1 and f.get("explorer.engine", streamrft_default("explorer.engine")) != "vllm":
        conv.set(
            "explorer.engine",
            "vllm",
            f"tensor_parallel_size {tp}: only vllm splits a model over GPUs (the vllm extra)",
        )
    if f.get("explorer.repeat_times", 2) < 2:
        conv.set(
            "explorer.repeat_times",
            streamrft_default("explorer.repeat_times"),
            f"{f['explorer.repeat_times']} rollout per task: streamrft compares 2 or more",
        )
    buffer, length = f.get("algorithm.overlong_buffer"), f.get("explorer.max_new_tokens")
    if buffer and isinstance(length, int) and buffer > length:
        del f["algorithm.overlong_buffer"], conv.reasons["algorithm.overlong_buffer"]
        conv.skip("algorithm.overlong_buffer", f"{buffer}: longer than the responses ({length})")
