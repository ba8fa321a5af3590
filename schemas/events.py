"""Control, status, metrics and dead-letter events.

Control events are a tagged union decoded by one typed decoder and dispatched with
``match``. Every struct here is plain msgspec: no torch, no aiokafka.
"""

from __future__ import annotations

import enum
import math

import msgspec

from streamrft.schemas import limits
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.limits import check_id


class ModelVersionReady(msgspec.Struct, tag="model_version_ready", kw_only=True):
    """A new model version is published and verified-readable at ``uri``."""

    version: int
    """The new version; strictly increasing within a run, never reused."""
    method: str
    """How the weights travel: ``object_store``, ``filesystem``, ``shared``, ``cuda_ipc``
    or ``nccl`` (``auto`` announces each version as ``cuda_ipc`` from a trainer on a GPU,
    as ``shared``, then as ``object_store``)."""
    uri: str
    """Where the manifest lies, e.g. ``s3://bucket/run/v000012/manifest.json``."""
    manifest_sha256: str
    """sha256 of the manifest object's bytes; the loader checks it first."""
    bytes: int
    """Total bytes of the weight shards."""
    step: int
    """Trainer step after which these weights were taken."""
    lora: bool = False
    """True when only a LoRA adapter was published."""
    created_at: float = 0.0
    """Unix time of publication."""
    base_version: int = -1
    """For an adapter-only version: the full version it applies on top of."""
    delta_base: int = -1
    """For a delta version: the version whose weights it changes (its tensors hold only the
    changed elements, ``synchronizer.delta``); -1: whole tensors."""
    state_sha256: str = ""
    """sha256 of the whole state the version makes (every tensor, in name order), set when
    the trainer publishes deltas: an explorer checks a rebuilt delta against it."""


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    """Ask every component of the run to stop after its current unit of work."""

    reason: str = ""
    """Why, for the logs."""
    created_at: float = 0.0
    """Unix time; components ignore a Shutdown from before they started (a resumed run)."""


class SyncRequest(msgspec.Struct, tag="sync_request", kw_only=True):
    """An explorer asks the trainer for a version at least ``min_version``."""

    explorer: str
    """Component id of the asking explorer."""
    min_version: int
    """Lowest version it can use."""
    created_at: float = 0.0
    """Unix time of the request."""


class VersionsRetired(msgspec.Struct, tag="versions_retired", kw_only=True):
    """The trainer deleted these versions (``synchronizer.keep_versions``): nobody loads them
    any more, and every view forgets them."""

    versions: list[int]
    """The versions retired, each announced before."""
    created_at: float = 0.0
    """Unix time of the retirement."""


class RunDefined(msgspec.Struct, tag="run_defined", kw_only=True):
    """What the run is: its resolved configuration, published on its control topic by the
    trainer when it starts, so that a process joining with only the run id and the broker
    (``--run-id ID --bootstrap HOST:PORT``) needs no file of the run's."""

    config_yaml: str
    """The resolved config as YAML, secrets read ``***`` (a joiner takes its own from the
    environment)."""
    fingerprints: dict[str, str] = {}
    """The field naming each task file or folder of the run (``taskset.path``,
    ``taskset.sources[0].path``, ``eval.path``) -> ``sha256:<hex>`` of its bytes: a feeder
    elsewhere checks its copy against it."""
    store_uri: str = ""
    """Where the same record lies in the object store (``s3://<bucket>/<run>/run.yaml``);
    empty when the run has no store."""
    created_at: float = 0.0
    """Unix time of publication; the newest one is the run's."""


ControlEvent = ModelVersionReady | Shutdown | SyncRequest | VersionsRetired | RunDefined


class RunState(str, enum.Enum):
    RUNNING = "RUNNING"
    REQUIRE_SYNC = "REQUIRE_SYNC"
    WAITING_SYNC = "WAITING_SYNC"
    STOPPED = "STOPPED"


class Rejection(msgspec.Struct, kw_only=True):
    """A version announcement a component refused, with the reason (``StatusEvent.rejected``)."""

    version: int
    """The version the announcement names."""
    method: str
    """Its ``method``."""
    manifest_sha256: str
    """Its ``manifest_sha256``: with ``version``, which announcement was refused."""
    reason: str
    """Why, in words."""
    kind: str
    """``integrity``: it was loaded and failed a check (never loaded again, by this component
    nor by it restarted: it reads its own last status at start); ``refused``: it points where
    the run does not allow (a method the run does not use, a rendezvous host not
    ``synchronizer.nccl_host``), so it was not loaded at all."""
    created_at: float = 0.0
    """Unix time of the refusal."""


class StatusEvent(msgspec.Struct, kw_only=True):
    """Heartbeat of one component, keyed by component id on ``<ns>.status``."""

    component: str
    """``trainer``, ``explorer-0``, ``feeder``..."""
    role: str
    """``trainer``, ``explorer``, ``feeder`` or ``supervisor``."""
    state: RunState
    """Where the component is in the sync protocol."""
    step: int
    """Steps done (explorer and trainer steps; epochs published for the feeder)."""
    version: int
    """Model version the component holds (-1 before its first)."""
    created_at: float = 0.0
    """Unix time of the heartbeat."""
    detail: str = ""
    """Human-readable note (what it waits for, why it stopped)."""
    counters: dict[str, float] = {}
    """Running totals (groups published, versions applied, ...)."""
    starved: bool = False
    """Trainer only: it has waited a while for experiences with no batch to train. Under
    the fixed style an explorer waiting for a version the trainer cannot make without
    more data then explores on with the newest version instead of waiting forever."""
    working: bool = False
    """An explorer: it holds tasks it has not published the groups of yet (a rollout, a
    version download); a serve process: it holds responses waiting for a reward or a
    commit, or groups waiting to be published (its spool). While one says so, the
    trainer's ``trainer.idle_timeout_s`` does not run out, however long a step or an
    episode takes."""
    rejected: list[Rejection] = []
    """The version announcements this component refused, newest last (at most
    ``limits.MAX_REJECTIONS_REPORTED``): every heartbeat repeats them, so the latest status
    of a component is its memory of them."""


class TrainedGroup(msgspec.Struct, array_like=True):
    """Ledger row: one group a trainer step used, and the version it was sampled with."""

    group_id: str
    """Id of the experience group."""
    model_version: int
    """Version that sampled it."""


class MetricsEvent(msgspec.Struct, kw_only=True):
    """Per-step numbers from a component, keyed by run on ``<ns>.metrics``."""

    run: str
    """Run id."""
    component: str
    """Component id that measured the values."""
    step: int
    """The component's step the values belong to."""
    version: int
    """Model version the component held (the trainer: before this step's publish)."""
    values: dict[str, float]
    """Named numbers, ``<area>/<name>`` (``train/loss``, ``eval/accuracy``...)."""
    created_at: float = 0.0
    """Unix time of the measurement."""
    trained: list[TrainedGroup] = []
    """Trainer only: the ledger of groups this step trained on."""


class DeadLetter(msgspec.Struct, kw_only=True):
    """A message that failed to decode or validate, kept whole with the reason."""

    source_topic: str
    """Topic the message was read from."""
    partition: int
    """Its partition."""
    offset: int
    """Its offset."""
    key: bytes | None
    """The original key, unchanged."""
    value: bytes | None
    """The original value, unchanged (replay it once the cause is fixed)."""
    reason: str
    """What was wrong, as the decoder or validator said it."""
    error_type: str
    """Exception class name (``SchemaError``...)."""
    component: str
    """Component that rejected it."""
    created_at: float = 0.0
    """Unix time of the rejection."""


# -- validation (beyond msgspec's typing) ----------------------------------------------------


def _check_time(created_at: float, what: str) -> None:
    if not math.isfinite(created_at):
        raise SchemaError(f"{what}: created_at {created_at} is not finite")


def validate_control(event: ControlEvent) -> ControlEvent:
    """Ids and uris of sane length, versions and sizes that can be real, finite times."""
    match event:
        case ModelVersionReady():
            what = f"model_version_ready {event.version}"
            if event.version < 0:
                raise SchemaError(f"{what}: version < 0")
            if event.step < 0 or event.bytes < 0 or event.base_version < -1:
                raise SchemaError(
                    f"{what}: step {event.step}, bytes {event.bytes} and base_version "
                    f"{event.base_version} must be >= 0 (base_version >= -1)"
                )
            check_id(event.method, f"{what}: method")
            if not event.uri or len(event.uri) > limits.MAX_URI_CHARS:
                raise SchemaError(
                    f"{what}: uri of {len(event.uri)} characters (1..{limits.MAX_URI_CHARS})"
                )
            if len(event.manifest_sha256) > 128 or len(event.state_sha256) > 128:
                raise SchemaError(f"{what}: a sha256 of more than 128 chars")
            if event.delta_base < -1 or event.delta_base >= event.version:
                raise SchemaError(
                    f"{what}: delta_base {event.delta_base} (-1, or an earlier version)"
                )
            if event.delta_base >= 0 and (event.lora or not event.state_sha256):
                raise SchemaError(
                    f"{what}: a delta (delta_base {event.delta_base}) is of full weights "
                    "and carries state_sha256"
                )
        case Shutdown():
            what = "shutdown"
            if len(event.reason) > limits.MAX_URI_CHARS:
                raise SchemaError(f"{what}: reason of {len(event.reason)} characters")
        case SyncRequest():
            what = "sync_request"
            check_id(event.explorer, f"{what}: explorer")
            if event.min_version < 0:
                raise SchemaError(f"{what}: min_version {event.min_version} < 0")
        case RunDefined():
            what = "run_defined"
            if not event.config_yaml.strip():
                raise SchemaError(f"{what}: an empty config")
            if len(event.fingerprints) > limits.MAX_RUN_FILES or any(
                len(k) > limits.MAX_URI_CHARS or len(v) > 128 for k, v in event.fingerprints.items()
            ):
                raise SchemaError(
                    f"{what}: at most {limits.MAX_RUN_FILES} fingerprints of paths up to "
                    f"{limits.MAX_URI_CHARS} characters"
                )
            if len(event.store_uri) > limits.MAX_URI_CHARS:
                raise SchemaError(f"{what}: store_uri of {len(event.store_uri)} characters")
            size = len(event.config_yaml) + sum(
                len(k) + len(v) for k, v in event.fingerprints.items()
            )
            if size > limits.MAX_RUN_RECORD_CHARS:
                raise SchemaError(
                    f"{what}: {size} characters, more than {limits.MAX_RUN_RECORD_CHARS}"
                )
        case VersionsRetired():
            what = "versions_retired"
            if len(event.versions) > limits.MAX_RETIRED_PER_EVENT:
                raise SchemaError(
                    f"{what}: {len(event.versions)} versions, more than "
                    f"{limits.MAX_RETIRED_PER_EVENT}"
                )
            if any(v < 0 for v in event.versions):
                raise SchemaError(f"{what}: a negative version")
    _check_time(event.created_at, what)
    return event


def validate_status(event: StatusEvent) -> StatusEvent:
    check_id(event.component, "status: component")
    check_id(event.role, f"status of {event.component!r}: role")
    _check_time(event.created_at, f"status of {event.component!r}")
    return event


def validate_metrics(event: MetricsEvent) -> MetricsEvent:
    """Values may be NaN (a diverged loss is worth seeing); ids may not be absurd."""
    check_id(event.run, "metrics: run")
    check_id(event.component, "metrics: component")
    _check_time(event.created_at, f"metrics of {event.component!r}")
    for row in event.trained:
        check_id(row.group_id, f"metrics of {event.component!r}: ledger group id")
    return event
