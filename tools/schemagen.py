"""Generate the JSON Schema files of the wire types an application writes or reads.

    python -m tools.schemagen [--check] [--out DIR]

writes ``schemas/json/*.schema.json`` (JSON Schema 2020-12), or with ``--check`` exits 1
(printing a diff) when a checked-in file is stale. Types, defaults and the number bounds of
``msgspec.Meta`` come from ``msgspec.json.schema_components``; every property's
``description`` is the string under the field in the class body (read with :mod:`ast`, as
``tools.docgen`` reads it); the limits the validators of ``streamrft.schemas`` enforce are
added as keywords (:data:`LIMITS`), and the rules across fields as prose in the type's
description (:data:`RULES`).

- ``task.schema.json``: a task as JSON on ``<prefix>.<run>.tasks``.
- ``experience_group.schema.json``: an experience group as JSON on ``.experiences``
  (:class:`~streamrft.schemas.json_forms.ExperienceGroupJSON`: arrays as number arrays).
- ``control_event.schema.json``: the control events (msgpack only), so an app can follow
  model versions.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from streamrft.schemas import limits
from streamrft.schemas.codec import (
    CONTROL,
    EXPERIENCE_GROUP,
    HEADER_SCHEMA,
    HEADER_TYPE,
    SCHEMA_VERSION,
    TASK,
    Codec,
)
from streamrft.schemas.events import ControlEvent, ModelVersionReady, Shutdown, SyncRequest
from streamrft.schemas.experience import GROUP_KINDS, ChatMessage, Segment, Task
from streamrft.schemas.json_forms import (
    HEADER_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    ExperienceGroupJSON,
    ExperienceJSON,
)
from tools.docgen import _nested_structs, _prose, class_doc, field_docs

DIALECT = "https://json-schema.org/draft/2020-12/schema"
OUT_DIR = Path(__file__).resolve().parents[1] / "schemas" / "json"
"""Where the files are checked in (``streamrft/schemas/json`` once installed)."""

_ID = {"minLength": 1, "maxLength": limits.MAX_ID_CHARS}

LIMITS: dict[type, dict[str, dict[str, Any]]] = {
    Task: {"id": _ID, "workflow": _ID, "epoch": {"minimum": 0}, "batch": {"minimum": -1}},
    ChatMessage: {"role": _ID},
    Segment: {"start": {"minimum": 0}, "version": {"minimum": 0}},
    ExperienceGroupJSON: {
        "id": _ID,
        "run": _ID,
        "task_id": _ID,
        "explorer": _ID,
        "workflow": _ID,
        "model_version": {"minimum": 0},
        "experiences": {"minItems": 1, "maxItems": limits.MAX_EXPERIENCES_PER_GROUP},
        "batch": {"minimum": -1},
        "kind": {"enum": list(GROUP_KINDS)},
    },
    ExperienceJSON: {
        "id": _ID,
        "tokens": {"minItems": 2, "maxItems": limits.MAX_TOKENS_PER_EXPERIENCE},
        "prompt_length": {"minimum": 1},
        "logprobs": {"items": {"minimum": limits.MIN_LOGPROB, "maximum": limits.MAX_LOGPROB}},
        "reward": {"minimum": -limits.MAX_ABS_REWARD, "maximum": limits.MAX_ABS_REWARD},
        "model_version": {"minimum": 0},
        "segments": {"maxItems": limits.MAX_SEGMENTS_PER_EXPERIENCE},
    },
    ModelVersionReady: {
        "version": {"minimum": 0},
        "method": _ID,
        "uri": {"minLength": 1, "maxLength": limits.MAX_URI_CHARS},
        "manifest_sha256": {"maxLength": 128},
        "bytes": {"minimum": 0},
        "step": {"minimum": 0},
        "base_version": {"minimum": -1},
        "delta_base": {"minimum": -1},
        "state_sha256": {"maxLength": 128},
    },
    SyncRequest: {"explorer": _ID, "min_version": {"minimum": 0}},
    Shutdown: {"reason": {"maxLength": limits.MAX_URI_CHARS}},
}
"""Per type and field, the JSON Schema keywords of what ``validate_task``,
``validate_group`` and ``validate_control`` check on one field alone (ids and names: 1 to
``MAX_ID_CHARS`` characters; counts and value ranges from :mod:`streamrft.schemas.limits`)."""

RULES: dict[type, str] = {
    Task: "An explorer dead-letters a task whose `workflow` it does not know.",
    ExperienceJSON: (
        "Checked on decoding beyond the keywords here: `prompt_length` is less than the "
        "length of `tokens`; `logprobs` and `action_mask` hold one entry per response token "
        "(the length of `tokens` minus `prompt_length`); `model_version` is the group's or "
        "newer; `segments`, when given, start at 0 with `model_version`, then each later "
        "in the response (before its end) with a newer version. "
        "A trainer also rejects a token id outside its model's vocabulary."
    ),
    ExperienceGroupJSON: (
        "A group of kind `preference` holds exactly 2 experiences (chosen first, then "
        "rejected) with the same prompt tokens; a trainer rejects a preference group unless "
        "it runs the `dpo` algorithm, and any other group when it does."
    ),
}
"""Rules across fields, which a keyword cannot state: appended to the type's description."""

INTEGERS = "Integer fields take JSON integers (`3`, not `3.0`)."


@dataclass(frozen=True)
class SchemaFile:
    """One generated file: the type it describes and how that type travels."""

    name: str
    root: Any
    title: str
    travel: str
    example: Callable[[], Any]
    """A valid instance (the JSON value), put in ``examples``."""


def _json_travel(kind: str, codec: Codec[Any], max_bytes: int) -> str:
    return (
        f"Published on the topic `<kafka.topic_prefix>.<run id>.{kind}` (prefix "
        f"`streamrft` by default) as one JSON object per Kafka record (UTF-8, at most "
        f"{max_bytes} bytes = {max_bytes >> 20} MiB), keyed by the task id, with the header "
        f"`{HEADER_CONTENT_TYPE}: {JSON_CONTENT_TYPE}` (without it a record is read as "
        f"msgpack). Optional headers: "
        f"`{HEADER_TYPE}` (`{codec.name}` when present) and `{HEADER_SCHEMA}` (at most "
        f"`{SCHEMA_VERSION}`). A record that does not decode or validate goes to "
        f"`<prefix>.<run id>.dead_letters` with the reason. Unknown properties are ignored. "
        f"{INTEGERS} `streamrft publish --run-id ID {kind} FILE.jsonl` validates and "
        f"publishes a file of them, one per line."
    )


def _task_example() -> Any:
    return {"id": "arith-00042", "prompt": "What is 2 + 3?", "answer": "5", "workflow": "math"}


def _group_example() -> Any:
    experiences = [
        {
            "id": f"my-run/arith-00042@0#{i}",
            "tokens": [1, 5, 6, 7, 8 + i, 2],
            "prompt_length": 4,
            "logprobs": [-0.5, -0.25],
            "action_mask": [1, 1],
            "reward": float(i),
            "model_version": 3,
            "response_text": f"{4 + i}",
        }
        for i in range(2)
    ]
    return {
        "id": "my-run/arith-00042@0",
        "run": "my-run",
        "task_id": "arith-00042",
        "explorer": "my-app",
        "model_version": 3,
        "experiences": experiences,
        "workflow": "my-app",
    }


def _control_example() -> Any:
    return {
        "type": "model_version_ready",
        "version": 3,
        "method": "object_store",
        "uri": "s3://streamrft/my-run/v000003/manifest.json",
        "manifest_sha256": "ab" * 32,
        "bytes": 1048576,
        "step": 3,
        "created_at": 1763900000.0,
    }


FILES = (
    SchemaFile(
        "task.schema.json",
        Task,
        "streamrft task (JSON form)",
        _json_travel("tasks", TASK, limits.TASK_MAX_BYTES),
        _task_example,
    ),
    SchemaFile(
        "experience_group.schema.json",
        ExperienceGroupJSON,
        "streamrft experience group (JSON form)",
        _json_travel("experiences", EXPERIENCE_GROUP, limits.DATA_MAX_BYTES),
        _group_example,
    ),
    SchemaFile(
        "control_event.schema.json",
        ControlEvent,
        "streamrft control event (msgpack only)",
        "Read from the topic `<kafka.topic_prefix>.<run id>.control`, which carries msgpack "
        "only (no JSON form): each record is a msgpack map with the properties described "
        f"here, tagged by `type`, with the headers `{HEADER_TYPE}: {CONTROL.name}` and "
        f"`{HEADER_SCHEMA}: {SCHEMA_VERSION}`. An app follows model versions by reading "
        "`model_version_ready` events from the beginning of the topic (the newest `version` "
        "is the current policy). Unknown properties are ignored.",
        _control_example,
    ),
)


# -- generation ---------------------------------------------------------------------------
def _text(doc: str) -> str:
    """A docstring as plain text: Sphinx roles as code spans, one line per paragraph."""
    paragraphs = _prose(doc).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _structs(root: Any) -> dict[str, type]:
    """Every struct named in ``root`` (through unions and containers), by class name."""
    found: dict[str, type] = {}

    def visit(cls: type) -> None:
        if cls.__name__ in found:
            return
        found[cls.__name__] = cls
        for f in msgspec.structs.fields(cls):
            for inner in _nested_structs(f.type):
                visit(inner)

    for cls in _nested_structs(root) if not _is_struct(root) else [root]:
        visit(cls)
    return found


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _describe(definition: dict[str, Any], cls: type) -> None:
    """Descriptions from the source, limits and rules added, in place."""
    description = _text(class_doc(cls))
    if cls in RULES:
        description += f"\n\n{RULES[cls]}"
    definition["description"] = description
    docs = field_docs(cls)
    properties = definition["properties"]
    extra = LIMITS.get(cls, {})
    unknown = set(extra) - set(properties)
    if unknown:
        raise RuntimeError(f"schemagen: LIMITS names fields {cls.__name__} lacks: {unknown}")
    for name, prop in properties.items():
        _merge(prop, extra.get(name, {}))
        if name == cls.__struct_config__.tag_field:
            prop["description"] = f"The event's type tag: `{cls.__struct_config__.tag}`."
        elif name in docs:
            prop["description"] = _text(docs[name])
        else:
            raise RuntimeError(f"schemagen: {cls.__name__}.{name} has no docstring")
    # description first, after the title (the order a reader wants)
    ordered = {"title": definition.pop("title"), "description": definition.pop("description")}
    definition.update({**ordered, **{k: definition.pop(k) for k in list(definition)}})


def schema_of(spec: SchemaFile) -> dict[str, Any]:
    """The JSON Schema document of one file: the root type's definition at the top level
    (so that tools of any draft read it), the types it contains under ``$defs``."""
    (root_ref,), defs = msgspec.json.schema_components([spec.root])
    for name, cls in _structs(spec.root).items():
        _describe(defs[name], cls)
    if "$ref" in root_ref:  # a struct: its definition becomes the document
        root_name = root_ref["$ref"].rsplit("/", 1)[-1]
        body = defs.pop(root_name)
        body.pop("title")
        description = body.pop("description")
    else:  # a tagged union
        body, description = root_ref, ""
    doc: dict[str, Any] = {
        "$schema": DIALECT,
        "title": spec.title,
        "description": f"{description}\n\n{spec.travel}".strip(),
        **body,
        "examples": [spec.example()],
    }
    if defs:
        doc["$defs"] = defs
    return doc


def render(spec: SchemaFile) -> str:
    return json.dumps(schema_of(spec), indent=2, ensure_ascii=False) + "\n"


def generated() -> dict[str, str]:
    """File name -> its text, for every file of :data:`FILES`."""
    return {spec.name: render(spec) for spec in FILES}


# -- command line -------------------------------------------------------------------------
def _stale(out: Path, files: dict[str, str]) -> list[str]:
    """Diff lines of every file that differs from ``files`` (or is missing), and stray
    ``*.schema.json`` files that are no longer generated."""
    lines: list[str] = []
    for name, new in files.items():
        path = out / name
        old = path.read_text() if path.is_file() else ""
        if old != new:
            diff = difflib.unified_diff(
                old.splitlines(), new.splitlines(), str(path), f"{path} (generated)", lineterm=""
            )
            lines += list(diff) or [f"{path}: differs"]
    for path in sorted(out.glob("*.schema.json")):
        if path.name not in files:
            lines.append(f"{path}: no longer generated (delete it)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.schemagen",
        description="Regenerate the JSON Schema files of the wire types (schemas/json/).",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"default: {OUT_DIR}")
    args = parser.parse_args(argv)
    files = generated()
    stale = _stale(args.out, files)
    if not stale:
        print(f"{args.out}: up to date")
        return 0
    if args.check:
        print("\n".join(stale[:80]))
        if len(stale) > 80:
            print(f"... ({len(stale) - 80} more lines)")
        print(f"{args.out} is stale; run: python -m tools.schemagen")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text)
    for path in args.out.glob("*.schema.json"):
        if path.name not in files:
            path.unlink()
    print(f"{args.out}: updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
