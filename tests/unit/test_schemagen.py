"""The JSON Schema files (``schemas/json/``) are generated from the wire types, and say what
the decoders accept: what the codecs write validates, and what a schema keyword forbids the
codecs reject.

Validated with a small JSON Schema validator written here (the ``jsonschema`` package is not
a dependency); it refuses a keyword it does not know, so a schema cannot state a rule that
goes unchecked.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from streamrft.schemas import (
    CONTROL,
    EXPERIENCE_GROUP,
    TASK,
    ChatMessage,
    Experience,
    ExperienceGroup,
    ModelVersionReady,
    SchemaError,
    Segment,
    Task,
)
from streamrft.schemas.json_forms import ExperienceGroupJSON, ExperienceJSON
from tests.helpers.groups import make_group
from tools import schemagen

pytestmark = pytest.mark.unit

FILES = {spec.name: spec for spec in schemagen.FILES}


# -- a small validator (the keywords schemagen writes, nothing else) ---------------------
ANNOTATIONS = {"$schema", "title", "description", "default", "examples", "$defs", "discriminator"}
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer())
    ),
}


class Invalid(Exception):
    pass


def validate(value: Any, schema: dict[str, Any], root: dict[str, Any], at: str = "$") -> None:
    """Raise :class:`Invalid` naming the path where ``value`` breaks ``schema``."""
    for key, rule in schema.items():
        if key in ANNOTATIONS:
            continue
        if key == "$ref":
            name = rule.removeprefix("#/$defs/")
            validate(value, root["$defs"][name], root, at)
        elif key == "anyOf":
            errors = []
            for option in rule:
                try:
                    validate(value, option, root, at)
                    break
                except Invalid as exc:
                    errors.append(str(exc))
            else:
                raise Invalid(f"{at}: matches none of anyOf ({'; '.join(errors)})")
        else:
            _check(key, rule, value, schema, root, at)


def _check(key: str, rule: Any, value: Any, schema: dict, root: dict, at: str) -> None:
    is_num = TYPES["number"](value)
    if key == "type":
        ok = TYPES[rule](value)
    elif key == "enum":
        ok = value in rule
    elif key in ("minimum", "maximum"):
        ok = not is_num or (value >= rule if key == "minimum" else value <= rule)
    elif key in ("minLength", "maxLength"):
        n = len(value) if isinstance(value, str) else None
        ok = n is None or (n >= rule if key == "minLength" else n <= rule)
    elif key in ("minItems", "maxItems"):
        n = len(value) if isinstance(value, list) else None
        ok = n is None or (n >= rule if key == "minItems" else n <= rule)
    elif key == "required":
        ok = not isinstance(value, dict) or all(name in value for name in rule)
    elif key == "properties":
        if isinstance(value, dict):
            for name, sub in rule.items():
                if name in value:
                    validate(value[name], sub, root, f"{at}.{name}")
        ok = True
    elif key == "additionalProperties":
        if isinstance(value, dict):
            for name, item in value.items():
                if name not in schema.get("properties", {}):
                    validate(item, rule, root, f"{at}.{name}")
        ok = True
    elif key == "items":
        for i, item in enumerate(value if isinstance(value, list) else []):
            validate(item, rule, root, f"{at}[{i}]")
        ok = True
    else:
        raise AssertionError(f"the test's validator does not know the keyword {key!r}")
    if not ok:
        raise Invalid(f"{at}: {key} {rule!r} fails for {str(value)[:60]!r}")


def _schema(name: str) -> dict[str, Any]:
    return json.loads((schemagen.OUT_DIR / name).read_text())


def _is_valid(value: Any, schema: dict[str, Any]) -> bool:
    try:
        validate(value, schema, schema)
    except Invalid:
        return False
    return True


# -- the files are up to date -------------------------------------------------------------
def test_checked_in_files_are_what_the_tool_generates():
    files = schemagen.generated()
    assert set(files) == {"task.schema.json", "experience_group.schema.json", *FILES}
    for name, text in files.items():
        assert (schemagen.OUT_DIR / name).read_text() == text, "run: python -m tools.schemagen"
    assert schemagen.main(["--check"]) == 0


def test_check_fails_on_a_stale_missing_or_stray_file(tmp_path, capsys):
    assert schemagen.main(["--check", "--out", str(tmp_path)]) == 1  # all missing
    assert schemagen.main(["--out", str(tmp_path)]) == 0
    assert schemagen.main(["--check", "--out", str(tmp_path)]) == 0
    task = tmp_path / "task.schema.json"
    task.write_text(task.read_text().replace('"minLength": 1', '"minLength": 2', 1))
    capsys.readouterr()
    assert schemagen.main(["--check", "--out", str(tmp_path)]) == 1
    assert '"minLength": 2' in capsys.readouterr().out  # the diff
    assert schemagen.main(["--out", str(tmp_path)]) == 0
    (tmp_path / "old.schema.json").write_text("{}")
    assert schemagen.main(["--check", "--out", str(tmp_path)]) == 1
    assert schemagen.main(["--out", str(tmp_path)]) == 0
    assert not (tmp_path / "old.schema.json").exists()


def test_every_property_is_described_from_its_field_docstring():
    group = _schema("experience_group.schema.json")
    assert group["properties"]["run"]["description"] == (
        "Run id (the topic namespace) the group belongs to."
    )
    # Sphinx roles and rst literals become Markdown code spans
    exp = group["$defs"]["ExperienceJSON"]
    assert exp["properties"]["id"]["description"].startswith("`<group id>#<rollout index>`")
    assert "`Experience`" in exp["description"] and ":class:" not in exp["description"]
    for name in FILES:
        doc = _schema(name)
        for definition in [doc, *doc.get("$defs", {}).values()]:
            for prop, sub in definition.get("properties", {}).items():
                assert sub.get("description"), (name, prop)
    assert "content-type: application/json" in group["description"]
    assert "msgpack only" in _schema("control_event.schema.json")["description"]


# -- what the codecs write validates ------------------------------------------------------
def test_examples_validate_and_decode():
    for name, spec in FILES.items():
        schema = _schema(name)
        (example,) = schema["examples"]
        assert example == spec.example()
        validate(example, schema, schema)
    task = _schema("task.schema.json")["examples"][0]
    assert TASK.decode(json.dumps(task).encode(), TASK.json_headers()).id == task["id"]
    group = _schema("experience_group.schema.json")["examples"][0]
    decoded = EXPERIENCE_GROUP.decode(json.dumps(group).encode(), EXPERIENCE_GROUP.json_headers())
    assert decoded.experiences[1].reward == 1.0
    event = _schema("control_event.schema.json")["examples"][0]
    assert CONTROL.decode(msgspec.msgpack.encode(event)).version == event["version"]


def test_what_the_codecs_encode_validates():
    group = make_group("run-1", "task-7", 2, n=3, infos=[{"len": 2.0}] * 3, kind="rollouts")
    as_json = json.loads(EXPERIENCE_GROUP.encode_json(group))
    schema = _schema("experience_group.schema.json")
    validate(as_json, schema, schema)
    assert as_json["experiences"][0]["tokens"] == [1, 5, 6, 7, 8, 2]  # number arrays
    schema = _schema("task.schema.json")
    validate(json.loads(TASK.encode_json(_task())), schema, schema)
    schema = _schema("control_event.schema.json")
    validate(msgspec.msgpack.decode(CONTROL.encode(_ready())), schema, schema)


# -- what a keyword forbids the codecs reject ---------------------------------------------
def _bad(key: str, rule: Any, good: Any) -> Any:
    """A value that breaks ``key: rule`` and nothing else a keyword states."""
    if key == "minimum":
        return rule - 1
    if key == "maximum":
        return rule + 1 if isinstance(rule, int) else rule * 2 + 1
    if key == "minLength":
        return "x" * (rule - 1)
    if key == "maxLength":
        return "x" * (rule + 1)
    if key == "minItems":
        return good[: rule - 1]
    if key == "maxItems":
        return [good[0]] * (rule + 1)
    assert key == "enum"
    return "no-such-" + str(rule[0])


LIMIT_KEYS = ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "enum")


def _violations(
    instance: dict[str, Any], definition: dict[str, Any], root: dict[str, Any], at: str = "$"
) -> Iterator[tuple[str, Any]]:
    """``(where, document)`` for each limit of ``definition`` broken on its own in a copy
    of the document whose part ``instance`` is (nested structs through ``$ref``)."""
    for name, prop in definition["properties"].items():
        assert name in instance, f"{at}.{name}: give the test instance every field"
        for key in LIMIT_KEYS:
            if key in prop:
                yield f"{at}.{name} {key}", (name, _bad(key, prop[key], instance[name]))
        items = prop.get("items", {})
        for key in LIMIT_KEYS:
            if key in items:
                bad = [_bad(key, items[key], None), *instance[name][1:]]
                yield f"{at}.{name}[0] {key}", (name, bad)
        if "$ref" in items and instance[name]:
            inner = root["$defs"][items["$ref"].rsplit("/", 1)[-1]]
            for where, (field, value) in _violations(instance[name][0], inner, root):
                item = {**instance[name][0], field: value}
                yield f"{at}.{name}[0]{where[1:]}", (name, [item, *instance[name][1:]])


def _decode(name: str, doc: dict[str, Any]) -> Any:
    if name == "control_event.schema.json":
        return CONTROL.decode(msgspec.msgpack.encode(doc))
    codec = TASK if name == "task.schema.json" else EXPERIENCE_GROUP
    return codec.decode(json.dumps(doc).encode(), codec.json_headers())


def _task() -> Task:
    return Task(
        id="chat-1",
        workflow="math",
        epoch=1,
        batch=3,
        metadata={"source": "app"},
        messages=[ChatMessage(role="user", content="2 + 2?")],
    )


def _ready() -> ModelVersionReady:
    return ModelVersionReady(
        version=4,
        method="filesystem",
        uri="/tmp/v4/manifest.json",
        manifest_sha256="0" * 64,
        bytes=10,
        step=4,
        lora=True,
        base_version=2,
    )


def _partial_group() -> dict[str, Any]:
    """A group whose first experience is a partial rollout (two version segments)."""
    group = make_group("run-1", "task-7", 2, n=3, batch=0)
    first = msgspec.structs.replace(
        group.experiences[0], segments=[Segment(start=0, version=2), Segment(start=1, version=3)]
    )
    group = msgspec.structs.replace(group, experiences=[first, *group.experiences[1:]])
    return json.loads(EXPERIENCE_GROUP.encode_json(group))


INSTANCES = {  # every field present (msgspec writes defaults too)
    "task.schema.json": json.loads(TASK.encode_json(_task())),
    "experience_group.schema.json": _partial_group(),
    "control_event.schema.json": msgspec.msgpack.decode(CONTROL.encode(_ready())),
}


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_each_limit_a_schema_states_is_one_the_decoder_enforces(name):
    schema = _schema(name)
    good = INSTANCES[name]
    validate(good, schema, schema)
    _decode(name, good)
    definition = schema if "properties" in schema else schema["$defs"]["ModelVersionReady"]
    cases = list(_violations(good, definition, schema))
    assert len(cases) >= {"task": 8, "experience_group": 25, "control_event": 9}[name.split(".")[0]]
    for where, (field, value) in cases:
        doc = {**copy.deepcopy(good), field: value}
        assert not _is_valid(doc, schema), where  # the validator sees the break
        with pytest.raises(SchemaError):  # and so does the decoder
            _decode(name, doc)


def test_number_arrays_beyond_the_wire_types_are_refused():
    """JSON numbers the arrays cannot hold: a log-prob beyond float32 and a token id
    beyond int32."""
    schema = _schema("experience_group.schema.json")
    doc = FILES["experience_group.schema.json"].example()
    for field, value in (("logprobs", [-1e300, -0.5]), ("tokens", [1, 5, 6, 7, 2**31, 2])):
        bad = copy.deepcopy(doc)
        bad["experiences"][0][field] = value
        assert not _is_valid(bad, schema), field
        with pytest.raises(SchemaError):
            _decode("experience_group.schema.json", bad)


# -- the JSON form follows the wire types -------------------------------------------------
@pytest.mark.parametrize(
    ("form", "wire"), [(ExperienceJSON, Experience), (ExperienceGroupJSON, ExperienceGroup)]
)
def test_json_form_fields_are_the_wire_fields(form, wire):
    assert form.__struct_fields__ == wire.__struct_fields__
    defaults = [(f.name, f.default, f.default_factory) for f in msgspec.structs.fields(wire)]
    assert [(f.name, f.default, f.default_factory) for f in msgspec.structs.fields(form)] == (
        defaults
    )
