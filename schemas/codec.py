"""Encoding and decoding of every wire type, with a schema-version header.

Each topic carries one type (the control topic a tagged union). A :class:`Codec` holds one
msgpack encoder and one typed decoder, created once and reused. Decoding first checks the
message's size against the codec's limit (:mod:`streamrft.schemas.limits`), then its headers,
then types (msgspec) and, where given, invariants (``validate``); any failure is a
:class:`~streamrft.schemas.errors.SchemaError` whose message says what was wrong. Nothing a
message can hold makes ``decode`` raise anything else (``tests/unit/test_fuzz_codecs.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import msgspec

from streamrft.schemas import limits
from streamrft.schemas.arrays import unpack_f32, unpack_i32
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.events import (
    ControlEvent,
    DeadLetter,
    MetricsEvent,
    StatusEvent,
    validate_control,
    validate_metrics,
    validate_status,
)
from streamrft.schemas.experience import (
    Experience,
    ExperienceGroup,
    Task,
    validate_group,
    validate_task,
)
from streamrft.schemas.json_forms import (
    HEADER_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    ExperienceGroupJSON,
    group_from_json,
    group_to_json,
)
from streamrft.schemas.manifest import WeightManifest
from streamrft.schemas.samples import Sample, validate_sample

SCHEMA_VERSION = 1
"""Bumped only for an incompatible change; additive changes keep it (fields at the end)."""
HEADER_SCHEMA = "streamrft-schema"
HEADER_TYPE = "streamrft-type"

T = TypeVar("T")
Headers = Sequence[tuple[str, bytes]]


class JsonForm(Generic[T]):
    """How a wire type travels as JSON (:mod:`streamrft.schemas.json_forms`): the JSON
    type and its conversions to and from the wire type (None: the same type)."""

    def __init__(
        self,
        type_: Any,
        to_wire: Callable[[Any], T] | None = None,
        from_wire: Callable[[T], Any] | None = None,
    ) -> None:
        self.type = type_
        self.to_wire = to_wire or (lambda obj: obj)
        self.from_wire = from_wire or (lambda obj: obj)
        self.decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(type_)


class Codec(Generic[T]):
    """msgpack codec of one wire type; ``name`` travels in the ``streamrft-type`` header.

    ``max_bytes`` bounds the encoded message; a longer one is refused before decoding. With
    a ``json`` form, a message whose ``content-type`` header is ``application/json`` is
    decoded from JSON instead (apps in other languages); the same limits and validation
    apply.
    """

    def __init__(
        self,
        type_: Any,
        name: str,
        validate: Callable[[T], T] | None = None,
        max_bytes: int = limits.EVENT_MAX_BYTES,
        json: JsonForm[T] | None = None,
    ) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)
        self._validate = validate
        self._json = json
        self._json_encoder = msgspec.json.Encoder()
        self._headers = [
            (HEADER_SCHEMA, str(SCHEMA_VERSION).encode()),
            (HEADER_TYPE, name.encode()),
        ]

    @property
    def accepts_json(self) -> bool:
        """Whether this type has a JSON form (tasks and experience groups)."""
        return self._json is not None

    def encode(self, obj: T) -> bytes:
        return self._encoder.encode(obj)

    def headers(self) -> list[tuple[str, bytes]]:
        return list(self._headers)

    def encode_json(self, obj: T) -> bytes:
        """The JSON form of ``obj`` (send it with :meth:`json_headers`)."""
        if self._json is None:
            raise SchemaError(f"{self.name}: has no JSON form")
        return self._json_encoder.encode(self._json.from_wire(obj))

    def json_headers(self) -> list[tuple[str, bytes]]:
        return [*self._headers, (HEADER_CONTENT_TYPE, JSON_CONTENT_TYPE.encode())]

    def decode(self, value: bytes | None, headers: Headers | None = None) -> T:
        if value is None:
            raise SchemaError(f"{self.name}: empty message (null value)")
        if len(value) > self.max_bytes:
            raise SchemaError(
                f"{self.name}: message of {len(value)} bytes is over the limit of "
                f"{self.max_bytes} bytes"
            )
        as_json = headers is not None and bool(headers) and self._check_headers(headers)
        try:
            obj = self._json_decode(value) if as_json else self._decoder.decode(value)
        # ValidationError is a DecodeError; msgspec lets invalid UTF-8 in a str through as
        # UnicodeDecodeError, and nesting deeper than its limit (in an unknown field, which
        # it skips) as RecursionError
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise SchemaError(f"{self.name}: {exc}") from exc
        except RecursionError as exc:
            raise SchemaError(f"{self.name}: nested too deeply ({exc})") from exc
        if self._validate is not None:
            obj = self._validate(obj)
        return obj

    def _json_decode(self, value: bytes) -> T:
        assert self._json is not None
        return self._json.to_wire(self._json.decoder.decode(value))

    def _check_headers(self, headers: Headers) -> bool:
        """Raise on a wrong type or too new a schema; True when the message is JSON."""
        found = dict(headers)
        kind = found.get(HEADER_TYPE)
        if kind is not None and kind != self._headers[1][1]:
            raise SchemaError(f"{self.name}: message is of type {kind.decode(errors='replace')!r}")
        version = found.get(HEADER_SCHEMA)
        if version is not None:
            try:
                major = int(version)
            except ValueError as exc:
                raise SchemaError(f"{self.name}: bad schema header {version!r}") from exc
            if major > SCHEMA_VERSION:
                raise SchemaError(
                    f"{self.name}: schema version {major} is newer than this reader's "
                    f"{SCHEMA_VERSION}; upgrade streamrft"
                )
        return self._is_json(found.get(HEADER_CONTENT_TYPE))

    def _is_json(self, content_type: bytes | None) -> bool:
        if content_type is None:
            return False
        kind = content_type.split(b";")[0].strip().lower()
        if kind == JSON_CONTENT_TYPE.encode():
            if self._json is None:
                raise SchemaError(f"{self.name}: JSON is accepted only on tasks and experiences")
            return True
        if kind == MSGPACK_CONTENT_TYPE.encode():
            return False
        raise SchemaError(
            f"{self.name}: content-type {content_type[:80].decode(errors='replace')!r} is "
            f"neither {JSON_CONTENT_TYPE} nor {MSGPACK_CONTENT_TYPE}"
        )


TASK: Codec[Task] = Codec(Task, "task", validate_task, limits.TASK_MAX_BYTES, JsonForm(Task))
EXPERIENCE_GROUP: Codec[ExperienceGroup] = Codec(
    ExperienceGroup,
    "experience_group",
    validate_group,
    limits.DATA_MAX_BYTES,
    JsonForm(ExperienceGroupJSON, group_from_json, group_to_json),
)
CONTROL: Codec[ControlEvent] = Codec(
    ControlEvent, "control", validate_control, limits.EVENT_MAX_BYTES
)
STATUS: Codec[StatusEvent] = Codec(StatusEvent, "status", validate_status, limits.EVENT_MAX_BYTES)
METRICS: Codec[MetricsEvent] = Codec(
    MetricsEvent, "metrics", validate_metrics, limits.METRICS_MAX_BYTES
)
DEAD_LETTER: Codec[DeadLetter] = Codec(DeadLetter, "dead_letter", None, limits.DATA_MAX_BYTES)
SAMPLE: Codec[Sample] = Codec(Sample, "sample", validate_sample, limits.EVENT_MAX_BYTES)

CODEC_BY_KIND: dict[str, Codec[Any]] = {
    "tasks": TASK,
    "experiences": EXPERIENCE_GROUP,
    "control": CONTROL,
    "status": STATUS,
    "metrics": METRICS,
    "dead_letters": DEAD_LETTER,
    "samples": SAMPLE,
}
"""Codec for each topic kind of a run namespace (see :mod:`streamrft.schemas.topics`)."""

DEAD_LETTER_REASON_CHARS = 2000
"""A reason is cut to this many characters (a validator may quote a long field)."""
DEAD_LETTER_MARGIN_BYTES = limits.DEAD_LETTER_MARGIN_BYTES


def dead_letter_of(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    exc: BaseException,
    component: str,
    max_bytes: int = limits.DATA_MAX_BYTES,
) -> DeadLetter:
    """The dead letter of a rejected message, small enough to publish in ``max_bytes``.

    The original key and value are kept whole when they fit (a record of the run's own
    producers always does: :data:`~.limits.DEAD_LETTER_MARGIN_BYTES`); one that does not is
    left out (None) and the reason says how long it was and where the record stays, so a
    dead letter can always be written.
    """
    reason = str(exc) or type(exc).__name__
    if len(reason) > DEAD_LETTER_REASON_CHARS:
        reason = f"{reason[:DEAD_LETTER_REASON_CHARS]}... ({len(reason)} characters)"
    room = min(max_bytes, DEAD_LETTER.max_bytes) - DEAD_LETTER_MARGIN_BYTES
    if key is not None and len(key) > room // 2:
        reason += f" [key of {len(key)} bytes not kept: too large for a dead letter]"
        key = None
    if value is not None and len(value) + len(key or b"") > room:
        reason += (
            f" [value of {len(value)} bytes not kept: too large for a dead letter; the record "
            f"stays at {topic}[{partition}]@{offset} for that topic's retention]"
        )
        value = None
    return DeadLetter(
        source_topic=topic,
        partition=partition,
        offset=offset,
        key=key,
        value=value,
        reason=reason,
        error_type=type(exc).__name__,
        component=component,
        created_at=time.time(),
    )


_MANIFEST_ENCODER = msgspec.json.Encoder()
_MANIFEST_DECODER = msgspec.json.Decoder(WeightManifest)


def encode_manifest(manifest: WeightManifest) -> bytes:
    """Manifests are JSON so that a person can read them in the object store."""
    return _MANIFEST_ENCODER.encode(manifest)


def decode_manifest(data: bytes) -> WeightManifest:
    try:
        return _MANIFEST_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"weight manifest: {exc}") from exc


def _readable_experience(exp: Experience) -> dict[str, Any]:
    view = msgspec.to_builtins(exp)
    view["tokens"] = unpack_i32(exp.tokens)
    view["logprobs"] = [round(x, 5) for x in unpack_f32(exp.logprobs)]
    view["action_mask"] = list(exp.action_mask)
    return view


def readable(obj: Any) -> Any:
    """A JSON-friendly view of any wire object (``msgspec.to_builtins``: bytes become base64),
    with token ids, log-probs and masks as number lists."""
    if isinstance(obj, ExperienceGroup):
        view = msgspec.to_builtins(obj)
        view["experiences"] = [_readable_experience(e) for e in obj.experiences]
        return view
    return msgspec.to_builtins(obj)
