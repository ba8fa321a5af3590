"""Generate the documentation's reference pages from the code.

A page holds generated blocks between markers::

    <!-- BEGIN GENERATED: config -->  ...  <!-- END GENERATED: config -->
    <!-- BEGIN GENERATED: schemas --> ...  <!-- END GENERATED: schemas -->
    <!-- BEGIN GENERATED: cli -->     ...  <!-- END GENERATED: cli -->

Types, defaults and bounds come from the msgspec structs; descriptions come from the string
literal that follows a field in the class body (read from the source with :mod:`ast`); the
command line's from its argparse parser.

    python -m tools.docgen [--check] [PAGE ...]

rewrites the blocks of each page in place (default: the pages of ``docs/reference/``), or
with ``--check`` exits 1 (printing a diff) when one is stale.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import msgspec

from streamrft.infra.config import Config, KafkaConfig
from streamrft.infra.source_docs import class_doc, field_docs, module_docs
from streamrft.schemas import codec as codec_mod
from streamrft.schemas.codec import CODEC_BY_KIND, HEADER_SCHEMA, HEADER_TYPE, SCHEMA_VERSION
from streamrft.schemas.manifest import WeightManifest
from streamrft.schemas.topics import TOPIC_KINDS, TopicNames

MARKERS = ("config", "schemas", "cli", "acls")
PAGES = (
    "docs/reference/configuration.md",
    "docs/reference/topics-and-schemas.md",
    "docs/reference/cli.md",
    "docs/reference/kafka-acls.md",
)
REQUIRED = "*required*"

# How each topic is keyed: written by hand from the producers (keys are call-site choices,
# not declared anywhere). schema_reference() fails if a topic kind is missing here.
TOPIC_KEYS: dict[str, str] = {
    # producers/feeder.py: key=task.id; the partition is chosen round-robin, not by key
    "tasks": "task id (`Task.id`); partition chosen round-robin by the feeder",
    # producers/explorer.py: key=g.task_id, so a group stays whole on one partition
    "experiences": "task id (`ExperienceGroup.task_id`)",
    # infra/bus.py EventSender.control / status / metrics / dead_letter
    "control": "id of the sending component",
    "status": "component id",
    "metrics": "run id",
    "dead_letters": "id of the component that could not handle the message",
    # producers/samples.py: a few decoded rollouts per explorer step
    "samples": "task id (`Sample.task_id`)",
}


# -- rendering helpers --------------------------------------------------------------------
_ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|exc|obj):`~?([^`]+)`")
_RST_CODE = re.compile(r"``([^`]+)``")


def _prose(text: str) -> str:
    """A docstring with Sphinx roles and ``rst literals`` turned into Markdown code spans."""

    def short(m: re.Match[str]) -> str:
        target = m.group(1)
        whole = m.group(0)
        return f"`{target.rsplit('.', 1)[-1] if '`~' in whole else target}`"

    return _RST_CODE.sub(r"`\1`", _ROLE.sub(short, text))


def cell(text: str) -> str:
    """Text safe inside one Markdown table cell."""
    return " ".join(_prose(text).split()).replace("|", "\\|")


def code(text: str) -> str:
    """``text`` as a code span inside a table cell (whitespace kept, ``|`` escaped)."""
    if not text:
        return ""
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    body = text.replace("|", "\\|").replace("\n", " ")
    return f"{fence}{pad}{body}{pad}{fence}"


def type_name(tp: Any) -> str:
    """An annotation as a reader writes it: ``str | None``, ``a | b`` for a Literal."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(str(a.value if isinstance(a, enum.Enum) else a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(type_name(a) for a in args)
    if tp is None or tp is type(None):
        return "None"
    if tp is Ellipsis:
        return "..."
    if origin is not None:
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(str(m.value) for m in tp)
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


def _metas(tp: Any) -> Iterator[msgspec.Meta]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        yield from (a for a in args[1:] if isinstance(a, msgspec.Meta))
        yield from _metas(args[0])
    elif origin is Union or origin is types.UnionType:
        for a in args:
            yield from _metas(a)


_BOUNDS = (
    ("ge", ">= {}"),
    ("gt", "> {}"),
    ("le", "<= {}"),
    ("lt", "< {}"),
    ("multiple_of", "multiple of {}"),
    ("min_length", "length >= {}"),
    ("max_length", "length <= {}"),
)


def bounds(tp: Any) -> str:
    """The msgspec.Meta constraints of an annotation, e.g. ``>= 0, <= 1``."""
    parts = []
    for meta in _metas(tp):
        parts += [
            fmt.format(getattr(meta, k)) for k, fmt in _BOUNDS if getattr(meta, k) is not None
        ]
        if meta.pattern is not None:
            parts.append(f"pattern `{meta.pattern}`")
    return ", ".join(parts).replace("|", "\\|")


def format_default(field: msgspec.structs.FieldInfo) -> str:
    """A field's default as JSON (valid YAML), or ``*required*``."""
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return REQUIRED
    return code(json.dumps(msgspec.to_builtins(value), ensure_ascii=False))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


# -- config -------------------------------------------------------------------------------
def config_reference() -> str:
    """Markdown: one ``### <section>`` with a table of its fields per Config section."""
    out: list[str] = []
    for section in msgspec.structs.fields(Config):
        cls = section.type
        if not _is_struct(cls):
            raise TypeError(f"Config.{section.name}: not a section struct ({cls!r})")
        out += _field_table(f"### {section.encode_name}", cls)
        for f in msgspec.structs.fields(cls):
            for inner in _nested_structs(f.type):
                many = typing.get_origin(f.type) is list
                title = f"#### {section.encode_name}.{f.encode_name}{'[]' if many else ''}"
                out += _field_table(title, inner)
    return "\n".join(out).rstrip("\n") + "\n"


def _field_table(title: str, cls: type) -> list[str]:
    """A heading, the class's docstring, and a table of its fields."""
    docs = field_docs(cls, grouped=True)
    out = [title, ""]
    if doc := class_doc(cls):
        out += [_prose(doc), ""]
    rows = [
        [
            code(f.encode_name),
            code(type_name(f.type)),
            format_default(f),
            bounds(f.type),
            cell(docs.get(f.name, "")),
        ]
        for f in msgspec.structs.fields(cls)
    ]
    return [*out, *_table(["field", "type", "default", "bounds", "description"], rows), ""]


# -- schemas ------------------------------------------------------------------------------
def _union_members(tp: Any) -> list[Any]:
    if typing.get_origin(tp) is Union or typing.get_origin(tp) is types.UnionType:
        return list(typing.get_args(tp))
    return [tp]


def _nested_structs(tp: Any) -> Iterator[type]:
    """Structs named in an annotation (through unions, containers and Annotated)."""
    if _is_struct(tp):
        yield tp
    for arg in typing.get_args(tp):
        yield from _nested_structs(arg)


def wire_structs() -> list[type]:
    """Every struct that travels: the topic types, the manifest, and what they contain."""
    roots = [m for kind in TOPIC_KINDS for m in _union_members(CODEC_BY_KIND[kind]._decoder.type)]
    seen: list[type] = []

    def visit(cls: type) -> None:
        if cls in seen:
            return
        seen.append(cls)
        for f in msgspec.structs.fields(cls):
            for inner in _nested_structs(f.type):
                visit(inner)

    for cls in [*roots, WeightManifest]:
        visit(cls)
    return seen


def _message_type(tp: Any) -> str:
    members = _union_members(tp)
    names = " \\| ".join(f"`{m.__name__}`" for m in members)
    if len(members) > 1:
        fields = {m.__struct_config__.tag_field for m in members}
        names += f" (tagged union on {', '.join(f'`{t}`' for t in sorted(fields))})"
    return names


def _partitions() -> dict[str, str]:
    """Partitions per topic kind, read from ``topic_specs`` (kafka.partitions or a number)."""
    from streamrft.infra.admin import topic_specs

    topics = TopicNames("p", "r")
    a = {s.name: s.num_partitions for s in topic_specs(KafkaConfig(partitions=2), topics)}
    b = {s.name: s.num_partitions for s in topic_specs(KafkaConfig(partitions=3), topics)}
    c = {s.name: s.num_partitions for s in topic_specs(KafkaConfig(partitions=2), topics, 5)}
    out = {}
    for kind in TOPIC_KINDS:
        name = topics.of(kind)
        out[kind] = "`kafka.partitions`" if (a[name], b[name]) == (2, 3) else str(a[name])
        if c[name] == 5:
            out[kind] += ", at least `explorer.count`"
    return out


def _struct_section(cls: type) -> list[str]:
    cfg = cls.__struct_config__
    title = f"#### {cls.__name__}"
    if cfg.tag is not None:
        title += f" (`{cfg.tag_field}: {cfg.tag}`)"
    out = [title, ""]
    if doc := class_doc(cls):
        out += [_prose(doc), ""]
    if cfg.array_like:
        out += ["Encoded as an array of its fields, in this order.", ""]
    docs = field_docs(cls, grouped=False)
    rows = [
        [
            code(f.encode_name),
            code(type_name(f.type)),
            format_default(f),
            cell(docs.get(f.name, "")),
        ]
        for f in msgspec.structs.fields(cls)
    ]
    return [*out, *_table(["field", "type", "default", "description"], rows), ""]


def schema_reference() -> str:
    """Markdown: the topics of a run, the message headers, and every wire struct."""
    missing = [k for k in TOPIC_KINDS if k not in TOPIC_KEYS]
    if missing:
        raise RuntimeError(f"docgen: no message key documented for topic kind(s) {missing}")
    parts = _partitions()
    consts = module_docs(codec_mod)
    out = [
        "### Topics",
        "",
        "Every run has its own topics, `<kafka.topic_prefix>.<run.id>.<kind>`, each created "
        "with `kafka.replication_factor` replicas.",
        "",
    ]
    rows = [
        [
            code(f"<prefix>.<run id>.{kind}"),
            code(CODEC_BY_KIND[kind].name),
            _message_type(CODEC_BY_KIND[kind]._decoder.type),
            cell(TOPIC_KEYS[kind]),
            parts[kind],
        ]
        for kind in TOPIC_KINDS
    ]
    out += _table(["topic", "codec", "message type", "key", "partitions"], rows)
    out += [
        "",
        "### Headers",
        "",
        "Values are msgpack; every message carries two headers.",
        "",
    ]
    rows = [
        [
            code(HEADER_SCHEMA),
            code(str(SCHEMA_VERSION)),
            cell(f"{consts.get('SCHEMA_VERSION', '')} A reader rejects a newer version.".strip()),
        ],
        [
            code(HEADER_TYPE),
            "the codec name (table above)",
            "A reader rejects a message of another type.",
        ],
    ]
    out += _table(["header", "value", "description"], rows)
    out += ["", "### Wire types", ""]
    intro = (
        "`WeightManifest` (with its `ShardInfo` list) is not sent on a topic: it lies beside "
        "the weight shards in the object store."
    )
    if doc := inspect.getdoc(codec_mod.encode_manifest):
        intro += f" {_prose(doc)}"
    out += [intro, ""]
    for cls in wire_structs():
        out += _struct_section(cls)
    return "\n".join(out).rstrip("\n") + "\n"


# -- the command line ---------------------------------------------------------------------
def _option_row(action: argparse.Action) -> list[str] | None:
    if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
        return None
    names = ", ".join(action.option_strings) or action.metavar or action.dest
    if action.option_strings and action.nargs != 0:
        names += f" {action.metavar or action.dest.upper()}"
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        names += f" ({' | '.join(str(c) for c in action.choices)})"
    help_text = (action.help or "").replace("%(default)s", str(action.default))
    optional_positional = not action.option_strings and action.nargs == "?"
    if optional_positional and "optional" not in help_text:
        help_text += " (optional)"
    if action.required and action.option_strings:
        help_text += " (required)"
    return [code(names), cell(_html_safe(help_text))]


def _html_safe(text: str) -> str:
    """``<run dir>`` and the like read as text, not as an HTML tag, in Markdown."""
    return text.replace("<", "&lt;").replace(">", "&gt;")


def cli_reference() -> str:
    """One section per ``streamrft`` command: what it does, its usage, its arguments."""
    from streamrft.app.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out: list[str] = []
    seen: set[int] = set()
    for name, command in sub.choices.items():
        if id(command) in seen:  # an alias
            continue
        seen.add(id(command))
        aliases = [n for n, c in sub.choices.items() if c is command and n != name]
        out.append(f"### streamrft {name}")
        out.append("")
        also = f" (also: `{'`, `'.join(aliases)}`)" if aliases else ""
        out.append(_html_safe(_prose(helps.get(name) or "")) + also)
        out.append("")
        usage = " ".join(command.format_usage().split())
        out.append(f"`{usage.removeprefix('usage: ')}`")
        out.append("")
        rows = [r for r in (_option_row(a) for a in command._actions) if r is not None]
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if rows:
            out += _table(["argument", "what it does"], rows)
            out.append("")
        for group in nested:
            for parser_ in group.choices.values():
                usage = " ".join(parser_.format_usage().split()).removeprefix("usage: ")
                out.append(f"`{usage}`")
                out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def acl_reference() -> str:
    """Each role of ``infra/access.py``: who plays it, and its ACLs on a run ``RUN`` under
    the default prefix."""
    from streamrft.infra.access import ROLES, acl_rows

    topics = TopicNames("streamrft", "RUN")
    out: list[str] = []
    for role, access in ROLES.items():
        out += [f"### {role}", "", f"{_prose(access.doc)}.", ""]
        rows = [[r.kind, r.pattern, code(r.name), r.operation] for r in acl_rows(topics, (role,))]
        out += _table(["resource", "pattern", "name", "operation"], rows)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


# -- pages --------------------------------------------------------------------------------
def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"


def render_page(page_text: str) -> str:
    """``page_text`` with each generated block it holds replaced (markers kept)."""
    bodies = {
        "config": config_reference,
        "schemas": schema_reference,
        "cli": cli_reference,
        "acls": acl_reference,
    }
    text = page_text
    present = [name for name in MARKERS if any(m in text for m in _markers(name))]
    if not present:
        raise ValueError("no generated block in it")
    for name in present:
        begin, end = _markers(name)
        if text.count(begin) != 1 or text.count(end) != 1:
            raise ValueError(f"expected exactly one {begin!r} and one {end!r}")
        start = text.index(begin) + len(begin)
        stop = text.index(end)
        if stop < start:
            raise ValueError(f"{end!r} comes before {begin!r}")
        text = f"{text[:start]}\n\n{bodies[name]().strip()}\n\n{text[stop:]}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.docgen", description="Regenerate the reference pages."
    )
    parser.add_argument("pages", nargs="*", default=list(PAGES), help="default: docs/reference/")
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args(argv)
    worst = 0
    for page in args.pages:
        worst = max(worst, _one_page(Path(page), args.check))
    return worst


def _one_page(path: Path, check: bool) -> int:
    try:
        old = path.read_text()
        new = render_page(old)
    except (OSError, ValueError) as exc:
        print(f"docgen: {path}: {exc}", file=sys.stderr)
        return 2
    if new == old:
        print(f"{path}: up to date")
        return 0
    if check:
        diff = list(
            difflib.unified_diff(
                old.splitlines(), new.splitlines(), f"{path}", f"{path} (generated)", lineterm=""
            )
        )
        print("\n".join(diff[:60]))
        if len(diff) > 60:
            print(f"... ({len(diff) - 60} more diff lines)")
        print(f"{path} is stale; run: python -m tools.docgen")
        return 1
    path.write_text(new)
    print(f"{path}: updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
