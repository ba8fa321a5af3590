"""Encoding and decoding of every wire type, with a schema-version header.

Each topic carries one type (the control topic a tagged union). A :class:`Codec` holds one
msgpack encoder and one typed decoder, created once and reused. Decoding validates types
(msgspec) and, where given, invariants (``validate``); any failure is a
:class:`~streamrft.schemas.errors.SchemaError` whose message says what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import msgspec

from streamrft.schemas.arrays import unpack_f32, unpack_i32
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.events import (
    ControlEvent,
    DeadLetter,
    MetricsEvent,
    StatusEvent,
)
from streamrft.schemas.experience import Experience, ExperienceGroup, Task, validate_group
from streamrft.schemas.weights import WeightManifest

SCHEMA_VERSION = 1
"""Bumped only for an incompatible change; additive changes keep it (fields at the end)."""
HEADER_SCHEMA = "streamrft-schema"
HEADER_TYPE = "streamrft-type"

T = TypeVar("T")
Headers = Sequence[tuple[str, bytes]]


class Codec(Generic[T]):
    """msgpack codec of one wire type; ``name`` travels in the ``streamrft-type`` header."""

    def __init__(self, type_: Any, name: str, validate: Callable[[T], T] | None = None) -> None:
        self.name = name
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)
        self._validate = validate
        self._headers = [
            (HEADER_SCHEMA, str(SCHEMA_VERSION).encode()),
            (HEADER_TYPE, name.encode()),
        ]

    def encode(self, obj: T) -> bytes:
        return self._encoder.encode(obj)

    def headers(self) -> list[tuple[str, bytes]]:
        return list(self._headers)

    def decode(self, value: bytes | None, headers: Headers | None = None) -> T:
        if value is None:
            raise SchemaError(f"{self.name}: empty message (null value)")
        if headers:
            self._check_headers(headers)
        try:
            obj = self._decoder.decode(value)
        except msgspec.DecodeError as exc:  # ValidationError is a subclass
            raise SchemaError(f"{self.name}: {exc}") from exc
        if self._validate is not None:
            obj = self._validate(obj)
        return obj

    def _check_headers(self, headers: Headers) -> None:
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


TASK: Codec[Task] = Codec(Task, "task")
EXPERIENCE_GROUP: Codec[ExperienceGroup] = Codec(
    ExperienceGroup, "experience_group", validate=validate_group
)
CONTROL: Codec[ControlEvent] = Codec(ControlEvent, "control")
STATUS: Codec[StatusEvent] = Codec(StatusEvent, "status")
METRICS: Codec[MetricsEvent] = Codec(MetricsEvent, "metrics")
DEAD_LETTER: Codec[DeadLetter] = Codec(DeadLetter, "dead_letter")

CODEC_BY_KIND: dict[str, Codec[Any]] = {
    "tasks": TASK,
    "experiences": EXPERIENCE_GROUP,
    "control": CONTROL,
    "status": STATUS,
    "metrics": METRICS,
    "dead_letters": DEAD_LETTER,
}
"""Codec for each topic kind of a run namespace (see :mod:`streamrft.schemas.topics`)."""

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


def to_builtins(obj: Any) -> Any:
    """A JSON-friendly view of any wire object (bytes become base64)."""
    return msgspec.to_builtins(obj)


def _readable_experience(exp: Experience) -> dict[str, Any]:
    view = msgspec.to_builtins(exp)
    view["tokens"] = unpack_i32(exp.tokens)
    view["logprobs"] = [round(x, 5) for x in unpack_f32(exp.logprobs)]
    view["action_mask"] = list(exp.action_mask)
    return view


def readable(obj: Any) -> Any:
    """Like :func:`to_builtins`, with token ids, log-probs and masks as number lists."""
    if isinstance(obj, ExperienceGroup):
        view = msgspec.to_builtins(obj)
        view["experiences"] = [_readable_experience(e) for e in obj.experiences]
        return view
    return msgspec.to_builtins(obj)
