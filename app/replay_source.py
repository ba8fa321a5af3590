"""``streamrft train ... --from-beginning | --from-offsets FILE | --from-run OTHER``: train
from a recorded experience stream with no explorers (the design is in
``consumers/replay.py``). This module turns the flags into a replay: which stream, on which
broker, whether this run id may take it, and its bounds, all checked before the model loads.

- ``--from-beginning``: the run's own ``experiences`` topic, from the first record of each
  partition (train-only: experiences an application published, e.g. with serve mode or
  ``streamrft publish``, for a run whose trainer never ran).
- ``--from-offsets FILE``: the same topic from the offsets in FILE (see
  ``consumers/replay.py`` for the format).
- ``--from-run OTHER``: OTHER's ``experiences`` topic (its namespace
  ``<prefix>.OTHER.experiences``), from the beginning or with ``--from-offsets``, while the
  versions, metrics, status, dead letters and checkpoints go under ``--run-id`` (which
  must differ from OTHER; its topics are created).

A replay trains from the initial model (``trainer.warmup_sft_steps`` as configured), so its
version numbers restart at 0 and a recorded group's ``model_version`` keeps its meaning for
``trainer.max_staleness``. Hence a run id that has announced versions already is refused
(every recorded group would be stale against them), and so is ``--from-beginning`` on a run
that has trained (a checkpoint): replay such a run into a new run id with ``--from-run``.
The one exception: a ``--from-run`` replay whose own checkpoint exists goes on from it
(``trainer.resume``), as an interrupted trainer does.

The broker: the config's or the command line's, else the source run's (its embedded
services while they run, or its resolved ``config.yaml``), else ``streamrft infra up``'s.
The embedded broker of a finished ``streamrft run`` stops with it and its topics are gone:
a run to be replayed must record on a broker that outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamrft.infra.config import Config, with_endpoints, with_run_id
from streamrft.infra.endpoints import of_run
from streamrft.schemas.errors import ConfigError, StreamRFTError
from streamrft.schemas.topics import TopicNames

if TYPE_CHECKING:  # the CLI's parser imports this module: torch and aiokafka only when used
    from streamrft.consumers.replay import ReplayBounds, ReplayCursor

log = logging.getLogger(__name__)

NEEDS_A_BROKER = (
    "a replay needs the broker that holds the recorded topics; the embedded broker of a "
    "finished `streamrft run` stopped with it. Record runs to replay on a broker that "
    "outlives them (`streamrft infra up`, which `run` and `train` then find, or "
    "kafka.bootstrap_servers) and replay on the same one (-o kafka.bootstrap_servers=HOST:PORT)"
)


def add_replay_arguments(sp: argparse.ArgumentParser) -> None:
    """The replay flags of ``streamrft train``."""
    start = sp.add_mutually_exclusive_group()
    start.add_argument(
        "--from-beginning",
        action="store_true",
        help="train from the recorded experiences topic, from its first record, with no "
        "explorers; stop at the end it had when the command started",
    )
    start.add_argument(
        "--from-offsets",
        metavar="FILE",
        help='the same, from the offsets in FILE: JSON {"<partition>": offset, ...}, every '
        "partition of the topic",
    )
    sp.add_argument(
        "--from-run",
        metavar="OTHER",
        help="replay run OTHER's experiences topic (from its beginning unless --from-offsets) "
        "into --run-id, which must differ",
    )


@dataclass(frozen=True)
class ReplayRequest:
    from_run: str | None
    offsets_file: str | None
    from_beginning: bool

    @classmethod
    def of(cls, args: argparse.Namespace) -> ReplayRequest | None:
        req = cls(
            getattr(args, "from_run", None),
            getattr(args, "from_offsets", None),
            bool(getattr(args, "from_beginning", False)),
        )
        return req if (req.from_run or req.offsets_file or req.from_beginning) else None


def prepare_replay(cfg: Config, args: argparse.Namespace) -> tuple[Config, ReplayCursor | None]:
    """``cfg`` (with the source run's broker where none was named) and the replay the flags
    ask for (None: no replay flag, a live trainer)."""
    from streamrft.consumers.replay import ReplayCursor, read_offsets_file

    req = ReplayRequest.of(args)
    if req is None:
        return cfg, None
    run_id = cfg.run.id
    assert run_id is not None
    if req.from_run == run_id:
        raise ConfigError(
            f"--from-run {req.from_run}: the same as --run-id; the replay writes its versions, "
            "metrics and checkpoints under --run-id: give a new one (or --from-beginning to "
            "train a run that never trained from its own stream)"
        )
    if cfg.trainer.world > 1:
        raise ConfigError(
            "trainer.nproc, trainer.nnodes: a replay runs one trainer process (set both to 1)"
        )
    offsets = read_offsets_file(req.offsets_file) if req.offsets_file else None
    source = req.from_run or run_id
    cfg = _with_source_broker(cfg, source)
    bounds = asyncio.run(_bounds(cfg, source, offsets, own=req.from_run is None))
    log.info("replay of run %s: %s", source, bounds.describe())
    return cfg, ReplayCursor(bounds)


def _with_source_broker(cfg: Config, source: str) -> Config:
    """``cfg`` with the source run's endpoints where it names none; a clear error when
    there is no broker, or the one found does not answer."""
    where = "the config"
    if not cfg.kafka.bootstrap_servers:
        try:
            found = of_run(with_run_id(cfg, source))
        except StreamRFTError as exc:
            raise StreamRFTError(f"{exc}: {NEEDS_A_BROKER}") from exc
        if found is not None:
            store = None if cfg.object_store.endpoint else found.s3_endpoint
            cfg, where = with_endpoints(cfg, found.bootstrap_servers, store), found.source
    servers = cfg.kafka.bootstrap_servers
    if not servers:
        raise StreamRFTError(f"no broker found for run {source}: {NEEDS_A_BROKER}")
    from streamrft.app.watch.run_events import reachable  # aiokafka: only when used

    if not reachable(servers, timeout=2.0):
        raise StreamRFTError(
            f"the broker {servers} (from {where}) does not answer: {NEEDS_A_BROKER}"
        )
    return cfg


async def _bounds(
    cfg: Config, source: str, offsets: dict[int, int] | None, own: bool
) -> ReplayBounds:
    """Check that this run id may take the replay (module docstring), create its topics,
    and read the bounds of the source stream."""
    from streamrft.consumers.checkpoint_folders import latest_checkpoint
    from streamrft.consumers.replay import read_bounds
    from streamrft.infra import admin
    from streamrft.sync.publisher import announced_floor

    topics = cfg.topics()
    existing = set(await admin.list_topics(cfg.kafka))
    stream = TopicNames(cfg.kafka.topic_prefix, source).experiences
    if stream not in existing:
        raise StreamRFTError(
            f"run {source}: no topic {stream} on the broker {cfg.kafka.bootstrap_servers}: "
            f"{NEEDS_A_BROKER}"
        )
    ckpt = latest_checkpoint(cfg.run_dir / "checkpoints")
    floor = await announced_floor(cfg) if topics.control in existing else -1
    if own and (ckpt is not None or floor >= 0):
        raise ConfigError(
            f"--from-beginning/--from-offsets: run {cfg.run.id} has trained already "
            f"({ckpt or f'versions up to {floor} announced'}); a replay starts from the "
            f"initial model: replay its stream into a new run id with --run-id NEW "
            f"--from-run {cfg.run.id}"
        )
    if floor >= 0 and not (ckpt is not None and cfg.trainer.resume):
        raise ConfigError(
            f"--run-id {cfg.run.id}: versions up to {floor} were announced under it and it has "
            "no checkpoint to resume; a replay's versions would come after them and every "
            "recorded group would be dropped as stale: replay into a fresh --run-id"
        )
    bounds = await read_bounds(cfg.kafka, stream, offsets)
    await admin.ensure_topics(cfg.kafka, topics)
    return bounds
