"""Generate the documentation's reference pages from the code.

A page holds generated blocks between markers::

    <!-- BEGIN GENERATED: config -->  ...  <!-- END GENERATED: config -->
    <!-- BEGIN GENERATED: schemas --> ...  <!-- END GENERATED: schemas -->
    <!-- BEGIN GENERATED: cli -->     ...  <!-- END GENERATED: cli -->

The ``config`` block is the index of the config sections; each section's fields are a page
of their own, wholly generated, in ``docs/reference/config/<section>.md`` (one page each
keeps every page under the voice check's length). Types, defaults and bounds come from the
msgspec structs; descriptions come from the string literal that follows a field in the
class body (read from the source with :mod:`ast`); the command line's from its argparse
parser.

    python -m tools.docgen [--check] [PAGE ...]

rewrites the blocks of each page in place, and the section pages (default: the pages of
``docs/reference/``, and ``docs/reference/config/``, where a page of no section is
removed), or with ``--check`` exits 1 (printing a diff) when one is stale, missing or left
over.
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
CONFIG_DIR = "docs/reference/config"
"""One generated page per Config section, ``<section>.md``; the index of them is the
``config`` block of ``docs/reference/configuration.md``."""
SECTION_SUMMARIES: dict[str, str] = {
    "run": "the run's name and id, its folder, seed, and start order",
    "kafka": "the broker: address, topics, producers and consumers, TLS and SASL",
    "object_store": "the S3 store of weight versions and checkpoints",
    "model": "the model: a folder or the tiny built-in one, device, dtype, LoRA",
    "taskset": "the tasks: files, columns, prompt template, answer extraction, mixing",
    "explorer": "the explorers: count, devices, engine, sampling, reward, agents",
    "trainer": "the trainer: devices and ranks, batches, optimizer, checkpoints, warm-up",
    "eval": "evaluation: tasks, evaluator processes, which versions, pass@k",
    "algorithm": "the RL algorithm: a preset and the parts that replace its own",
    "synchronizer": "how weight versions reach the explorers: method, style, deltas",
    "monitor": "progress, logs, metric exporters, dashboard, probes",
    "serve": "`streamrft serve`: the OpenAI-compatible API and what it records",
    "reward": "the reward services: a judge model, code tests in a sandbox",
}
"""What each section holds, for the index (written by hand; docgen fails on a section
missing here)."""


def config_sections() -> list[tuple[str, type]]:
    """``(name in YAML, section struct)`` of each Config section, in Config's order."""
    out = []
    for section in msgspec.structs.fields(Config):
        if not _is_struct(section.type):
            raise TypeError(f"Config.{section.name}: not a section struct ({section.type!r})")
        out.append((section.encode_name, section.type))
    return out


def config_reference() -> str:
    """Markdown: the index of the Config sections, each a link to its page."""
    missing = [name for name, _ in config_sections() if name not in SECTION_SUMMARIES]
    if missing:
        raise RuntimeError(f"docgen: no summary in SECTION_SUMMARIES for section(s) {missing}")
    folder = Path(CONFIG_DIR).name
    rows = [
        [f"[`{name}`]({folder}/{name}.md)", cell(SECTION_SUMMARIES[name])]
        for name, _ in config_sections()
    ]
    return "\n".join(_table(["section", "what it holds"], rows)) + "\n"


def config_section_page(name: str, cls: type) -> str:
    """The whole page of one Config section: a table of its fields, then one of each
    struct inside it (``model.lora``, ``taskset.sources[]``)."""
    out = [
        f"# Configuration: {name}",
        "",
        "<!-- Generated from infra/config.py by python -m tools.docgen: do not edit. -->",
        "",
        f"The fields of the `{name}:` section of a config file; every field has a default. "
        "[All sections](../configuration.md).",
        "",
    ]
    out += _field_table(f"## {name}", cls)
    for f in msgspec.structs.fields(cls):
        for inner in _nested_structs(f.type):
            many = typing.get_origin(f.type) is list
            out += _field_table(f"## {name}.{f.encode_name}{'[]' if many else ''}", inner)
    return "\n".join(out).rstrip("\n") + "\n"


def config_pages() -> dict[str, str]:
    """Path (from the repository root) -> text of each section's page."""
    return {
        f"{CONFIG_DIR}/{name}.md": config_section_page(name, cls) for name, cls in config_sections()
    }


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
    """One section per ``streamrft`` command (and per subcommand of ``tasks``, ``models``):
    what it does, its usage, its arguments."""
    from streamrft.app.cli import build_parser

    out: list[str] = []
    for name, aliases, helptext, command in _commands(build_parser(), "streamrft"):
        out += _command_section(name, aliases, helptext, command)
    return "\n".join(out).rstrip("\n") + "\n"


def _commands(
    parser: argparse.ArgumentParser, prog: str
) -> Iterator[tuple[str, list[str], str, argparse.ArgumentParser]]:
    """``(full name, aliases, help, parser)`` of each subcommand of ``parser``, each
    followed by its own subcommands."""
    for group in parser._actions:
        if not isinstance(group, argparse._SubParsersAction):
            continue
        helps = {c.dest: c.help for c in group._choices_actions}
        seen: set[int] = set()
        for name, command in group.choices.items():
            if id(command) in seen:  # an alias
                continue
            seen.add(id(command))
            aliases = [n for n, c in group.choices.items() if c is command and n != name]
            yield f"{prog} {name}", aliases, helps.get(name) or "", command
            yield from _commands(command, f"{prog} {name}")


def _command_section(
    name: str, aliases: list[str], helptext: str, command: argparse.ArgumentParser
) -> list[str]:
    also = f" (also: `{'`, `'.join(aliases)}`)" if aliases else ""
    usage = " ".join(command.format_usage().split()).removeprefix("usage: ")
    out = [f"### {name}", "", _html_safe(_prose(helptext)) + also, "", f"`{usage}`", ""]
    rows = [r for r in (_option_row(a) for a in command._actions) if r is not None]
    if rows:
        out += [*_table(["argument", "what it does"], rows), ""]
    return out


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
    parser.add_argument(
        "pages",
        nargs="*",
        help=f"default: docs/reference/ (the pages with generated blocks, and {CONFIG_DIR}/)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args(argv)
    whole = config_pages()
    pages = args.pages or [*PAGES, *whole]
    worst = 0
    for page in pages:
        worst = max(worst, _one_page(Path(page), args.check, whole))
    if not args.pages:
        worst = max(worst, _extra_pages(whole, args.check))
    return worst


def _one_page(path: Path, check: bool, whole: dict[str, str]) -> int:
    """Regenerate (or with ``check``, compare) one page: wholly from ``whole`` when it is
    one of those, else its generated blocks."""
    generated = whole.get(path.as_posix().removeprefix(f"{Path.cwd().as_posix()}/"))
    try:
        old = path.read_text() if path.exists() or generated is None else ""
        new = generated if generated is not None else render_page(old)
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
        print(f"{path} is {'stale' if old else 'missing'}; run: python -m tools.docgen")
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
    print(f"{path}: {'updated' if old else 'written'}")
    return 0


def _extra_pages(whole: dict[str, str], check: bool) -> int:
    """A page in CONFIG_DIR of no section (one removed from Config): an error with
    ``check``, else removed."""
    extra = sorted(p for p in Path(CONFIG_DIR).glob("*.md") if p.as_posix() not in whole)
    for page in extra:
        if check:
            print(f"{page}: no Config section has this page; run: python -m tools.docgen")
        else:
            page.unlink()
            print(f"{page}: removed (no Config section has it)")
    return 1 if extra and check else 0


if __name__ == "__main__":
    sys.exit(main())
