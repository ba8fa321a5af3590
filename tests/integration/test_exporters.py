"""Metric exporters and ``streamrft export-metrics``, read back with each backend's own reader.

TensorBoard's event files through ``EventAccumulator``, MLflow's file store through
``MlflowClient.get_metric_history``, W&B's offline run file (``run-<id>.wandb``, a
LevelDB-style log of protobuf records) through W&B's own record type: each holds exactly
the values sent, on each component's own step, and an export again appends only the new
steps. ``export-metrics`` runs as a second process against the session broker (a topic
of metrics events published here), follows it until SIGTERM, and falls back to the run's
``metrics.jsonl`` when no broker answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from streamrft.app.watch.exporters import open_exporters
from streamrft.app.watch.exporters.mlflow import RUN_TAG, tracking_uri
from streamrft.app.watch.exporters.names import folder, tag
from streamrft.app.watch.metrics_log import MetricsLog, metrics_path
from streamrft.infra import admin
from streamrft.infra.bus import EventSender
from streamrft.infra.config import from_dict, to_yaml
from streamrft.infra.net import free_port
from streamrft.schemas.codec import METRICS
from streamrft.schemas.errors import ServiceError
from streamrft.schemas.events import MetricsEvent
from tests.helpers.cli import env, start_piped, streamrft_cmd
from tests.helpers.paths import ADDITION
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0


def _events(run: str, upto: int = 4) -> list[MetricsEvent]:
    """Metrics of a small run: the trainer (train and eval values at the same step, in two
    events), two explorers at their own pace, a bench result; values and times exact in
    float32 / milliseconds so they compare equal after the round trip."""
    out: list[MetricsEvent] = []

    def add(component: str, step: int, values: dict[str, float]) -> None:
        created = T0 + 0.5 * len(out)
        ev = MetricsEvent(
            run=run, component=component, step=step, version=step, values=values, created_at=created
        )
        out.append(ev)

    for s in range(1, upto + 1):
        add("trainer", s, {"train/loss": 1 / 2**s, "train/reward_mean": 0.125 * s})
        add("explorer-0", s - 1, {"explorer/reward_mean": 0.25 * s})
        if s % 2 == 0:
            add("trainer", s, {"eval/accuracy": 0.25 * s})
        add("explorer-1", 2 * s, {"explorer/reward_mean": 0.5 * s})
    add("bench", upto, {"bench/pass@4": 0.75})
    return out


def _expected(events: list[MetricsEvent]) -> dict[tuple[str, str], list[tuple[int, float, float]]]:
    """(component folder, tag) -> [(step, value, created_at)], in order."""
    out: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for ev in events:
        for key, value in ev.values.items():
            out.setdefault((folder(ev.component), tag(key)), []).append(
                (ev.step, value, ev.created_at)
            )
    return out


def _appended(first: list[MetricsEvent], again: list[MetricsEvent]) -> list[MetricsEvent]:
    """What an export of ``again`` after one of ``first`` adds up to: ``first``, then the
    events of ``again`` at steps ``first`` did not have."""
    done = {(e.component, e.step) for e in first}
    return first + [e for e in again if (e.component, e.step) not in done]


def _config(tmp_path: Path, bootstrap: str | None = None, **monitor):
    data = {
        "run": {"name": "t", "id": "t-exporters", "dir": str(tmp_path / "runs")},
        "taskset": {"path": str(ADDITION)},
        "monitor": monitor,
    }
    if bootstrap:
        data["kafka"] = {"bootstrap_servers": bootstrap}
    return from_dict(data)


def _export(cfg, names: list[str], events: list[MetricsEvent]) -> None:
    exporters = open_exporters(cfg, names, strict=True)
    try:
        for ev in events:
            for exp in exporters:
                exp.write(ev)
        for exp in exporters:
            exp.flush()
    finally:
        for exp in exporters:
            exp.close()


# -- readers: each backend's own ---------------------------------------------------------------


def _tensorboard(root: Path) -> dict[tuple[str, str], list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    out = {}
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        # every value in the files, whatever TensorBoard's view would leave out
        acc = EventAccumulator(str(run), size_guidance={SCALARS: 0}, purge_orphaned_data=False)
        acc.Reload()
        for name in acc.Tags()["scalars"]:
            # in time order: TensorBoard reads a folder's files in name order, and two
            # files started in the same second of one process sort by a counter as text
            scalars = sorted(acc.Scalars(name), key=lambda e: e.wall_time)
            out[(run.name, name)] = [(e.step, e.value, e.wall_time) for e in scalars]
    return out


def _mlflow(cfg) -> dict[tuple[str, str], list[tuple[int, float, float]]]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as the exporter sets it
    client = MlflowClient(tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.monitor.mlflow.experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`{RUN_TAG}` = '{cfg.run.id}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]  # found again, never a second run
    run_id = runs[0].info.run_id
    out = {}
    for name in client.get_run(run_id).data.metrics:
        component, _, key = name.partition("/")
        history = sorted(
            client.get_metric_history(run_id, name), key=lambda m: (m.timestamp, m.step)
        )
        out[(component, key)] = [(m.step, m.value, m.timestamp / 1000) for m in history]
    return out


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file: a 7-byte header (``:W&B``, magic, version),
    then 32 KiB blocks of chunks, each ``crc32 u32, length u16, type u8`` + data (type 1: a
    whole record; 2, 3, 4: first, middle, last piece), as in LevelDB's log format."""
    from wandb.proto import wandb_internal_pb2 as pb

    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pieces = header, b""
    while pos + header <= len(data):
        if block - pos % block < header:  # the block's tail is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        chunk, pos = data[pos + header : pos + header + length], pos + header + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces + chunk)
            pieces = b""
            yield record
        elif kind in (2, 3):
            pieces += chunk


def _wandb_runs(cfg) -> list[Path]:
    """The offline run folders of ``cfg``'s run id, oldest first: ``offline-run-<time>-<id>``,
    and ``...-<id>-<n>`` for the n-th more started within the same second."""
    name = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(cfg.run.id)}(?:-(\d+))?")
    found = []
    for path in (cfg.run_dir / "wandb").iterdir():
        m = name.fullmatch(path.name)
        if m:
            found.append(((m.group(1), int(m.group(2) or 0)), path))
    return [path for _order, path in sorted(found)]


def _wandb(cfg) -> tuple[dict, dict[str, str]]:
    """Values by (component, tag) from the history rows of every offline run of ``cfg``'s
    run id, in order, each on the row's ``<component>/step``; and each metric glob's step
    metric (``define_metric``)."""
    runs = _wandb_runs(cfg)
    assert runs, list((cfg.run_dir / "wandb").iterdir())
    values: dict[tuple[str, str], list[tuple[int, float]]] = {}
    step_of: dict[str, str] = {}
    for run in runs:
        for record in _wandb_records(run / f"run-{cfg.run.id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "metric" and record.metric.glob_name:
                step_of[record.metric.glob_name] = record.metric.step_metric
            if kind != "history":
                continue
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            steps = {k.rpartition("/")[0]: v for k, v in row.items() if k.endswith("/step")}
            for key, value in row.items():
                component, _, name = key.partition("/")
                if component in steps and name != "step":
                    values.setdefault((component, name), []).append((steps[component], value))
    return values, step_of


def _children() -> list[str]:
    """Command names of this process's live children."""
    names = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields and fields[0] != "Z" and int(fields[1]) == os.getpid():
            names.append(stat.partition("(")[2].rpartition(")")[0])
    return names


# -- the exporters -----------------------------------------------------------------------------


def test_tensorboard_holds_every_value_on_each_components_step(tmp_path):
    cfg = _config(tmp_path)
    first = _events(cfg.run.id, upto=3)
    _export(cfg, ["tensorboard"], first)
    root = cfg.run_dir / "tensorboard"
    assert _tensorboard(root) == _expected(first)
    assert {p.name for p in root.iterdir()} == {"trainer", "explorer-0", "explorer-1", "bench"}
    assert ("bench", "bench/pass_at_4") in _tensorboard(root)

    # again, with everything from the beginning and one step more: only that step is added
    again = _events(cfg.run.id, upto=4)
    _export(cfg, ["tensorboard"], again)
    assert _tensorboard(root) == _expected(_appended(first, again))
    assert len(list((root / "trainer").glob("events.out.tfevents.*"))) == 2


def test_mlflow_holds_every_value_in_one_run_found_again_by_its_tag(tmp_path):
    cfg = _config(tmp_path, mlflow={"experiment": "exporters-test"})
    first = _events(cfg.run.id, upto=3)
    _export(cfg, ["mlflow"], first)
    assert tracking_uri(cfg) == (cfg.run_dir / "mlruns").resolve().as_uri()
    assert _mlflow(cfg) == _expected(first)

    again = _events(cfg.run.id, upto=4)
    _export(cfg, ["mlflow"], again)
    assert _mlflow(cfg) == _expected(_appended(first, again))  # no step twice


def test_wandb_offline_holds_every_value_and_stops_its_service(tmp_path):
    cfg = _config(tmp_path)
    assert cfg.monitor.wandb.mode == "offline"
    first = _events(cfg.run.id, upto=3)
    _export(cfg, ["wandb"], first)
    strip = {k: [(s, v) for s, v, _t in pts] for k, pts in _expected(first).items()}
    values, step_of = _wandb(cfg)
    assert values == strip
    for component in ("trainer", "explorer-0", "explorer-1", "bench"):
        assert step_of[f"{component}/*"] == f"{component}/step"
    # W&B's service process was shut down by close()
    deadline = time.monotonic() + 30
    while "wandb-core" in _children():
        assert time.monotonic() < deadline, "wandb-core still running after close()"
        time.sleep(0.2)
    core_log = next((cfg.run_dir / "wandb").glob("offline-run-*/logs/debug-core.log")).read_text()
    assert '"disable-analytics":true' in core_log  # no error reports to W&B's servers

    again = _events(cfg.run.id, upto=4)
    _export(cfg, ["wandb"], again)
    values, _ = _wandb(cfg)
    both = _expected(_appended(first, again))
    assert values == {k: [(s, v) for s, v, _t in pts] for k, pts in both.items()}
    assert len(_wandb_runs(cfg)) == 2


def _attempt(run: str, n: int, later: int) -> list[MetricsEvent]:
    """An explorer attempt counting its steps from 1 to ``n``, ``later`` seconds after the
    first one (a restart counts from 1 again), beside a trainer that goes on; values
    exact in float32."""
    out = []
    for s in range(1, n + 1):
        at = T0 + later + s
        values = {"explorer/reward_mean": s + later / 128}
        out.append(
            MetricsEvent(
                run=run, component="explorer-0", step=s, version=0, values=values, created_at=at
            )
        )
        step = later + s
        out.append(
            MetricsEvent(
                run=run,
                component="trainer",
                step=step,
                version=step,
                values={"train/loss": step / 4},
                created_at=at + 0.25,
            )
        )
    return out


def _read(cfg, name: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(component, tag) -> [(step, value)] as ``name``'s own reader sees them."""
    if name == "wandb":
        return _wandb(cfg)[0]
    found = _tensorboard(cfg.run_dir / "tensorboard") if name == "tensorboard" else _mlflow(cfg)
    return {key: [(s, v) for s, v, _t in pts] for key, pts in found.items()}


def _steps_values(events: list[MetricsEvent]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    return {key: [(s, v) for s, v, _t in pts] for key, pts in _expected(events).items()}


@pytest.mark.parametrize("name", ["tensorboard", "mlflow", "wandb"])
def test_a_restarted_explorers_steps_are_exported_again(tmp_path, name):
    # explorer-0 restarted by the supervisor while the exporter is open (one process)
    cfg = _config(tmp_path, mlflow={"experiment": "exporters-restart"})
    first, restarted = _attempt(cfg.run.id, 4, 0), _attempt(cfg.run.id, 2, 100)
    _export(cfg, [name], first + restarted)
    assert _read(cfg, name) == _steps_values(first + restarted)
    assert [s for s, _v in _read(cfg, name)[("explorer-0", "explorer/reward_mean")]] == [
        1, 2, 3, 4, 1, 2,
    ]  # fmt: skip

    # the run resumed: its monitor (or an export) reads everything again, and every
    # explorer starts from step 1 again; only the resumed attempt is added
    resumed = _attempt(cfg.run.id, 3, 200)
    _export(cfg, [name], first + restarted + resumed)
    assert _read(cfg, name) == _steps_values(first + restarted + resumed)


# -- streamrft export-metrics ------------------------------------------------------------------


async def _publish(cfg, events: list[MetricsEvent]) -> None:
    topics = cfg.topics()
    async with EventSender(cfg, "metrics-test", "test") as sender:
        for ev in events:
            await sender.send(topics.metrics, METRICS, ev, key=topics.run)


def _write_config(cfg, path: Path) -> Path:
    path.write_text(to_yaml(cfg, redact=False))
    return path


def _cli(*args: str, cwd: Path, pre: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """``streamrft ARGS`` as a second process; ``pre``: Python run first in it."""
    argv = (
        [
            sys.executable,
            "-c",
            f"{pre}; import sys; from streamrft.app.cli import main; sys.exit(main(sys.argv[1:]))",
            *args,
        ]
        if pre
        else streamrft_cmd(*args)
    )
    return subprocess.run(argv, env=env(), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_export_metrics_reads_the_topic_of_a_run(make_config, tmp_path):
    cfg = make_config()
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    events = _events(cfg.run.id)
    asyncio.run(_publish(cfg, events))
    config = _write_config(cfg, tmp_path / "config.yaml")

    proc = _cli(
        "export-metrics",
        str(config),
        "--run-id",
        cfg.run.id,
        "--to",
        "tensorboard",
        "--to",
        "mlflow",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from topic {cfg.topics().metrics}" in proc.stderr
    assert proc.stdout.startswith(f"exported {len(events)} metrics events of run {cfg.run.id}")
    assert str(cfg.run_dir / "tensorboard") in proc.stdout
    assert _tensorboard(cfg.run_dir / "tensorboard") == _expected(events)
    assert _mlflow(cfg) == _expected(events)


def test_export_metrics_follows_a_run_until_sigterm(make_config, tmp_path):
    cfg = make_config()
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    events = _events(cfg.run.id)
    half = len(events) // 2
    asyncio.run(_publish(cfg, events[:half]))
    # the config file names a broker that is gone; --bootstrap names the live one
    gone = msgspec.structs.replace(cfg.kafka, bootstrap_servers=f"127.0.0.1:{free_port()}")
    config = _write_config(msgspec.structs.replace(cfg, kafka=gone), tmp_path / "config.yaml")
    root = cfg.run_dir / "tensorboard"

    def holds(n: int) -> bool:
        return root.is_dir() and _tensorboard(root) == _expected(events[:n])

    argv = streamrft_cmd(
        "export-metrics",
        str(config),
        "--run-id",
        cfg.run.id,
        "--to",
        "tensorboard",
        "--follow",
        "--bootstrap",
        cfg.kafka.bootstrap_servers,
    )
    proc = start_piped(argv, tmp_path)
    try:
        wait_for(lambda: holds(half), proc, 120, "the first half in TensorBoard's files")
        asyncio.run(_publish(cfg, events[half:]))
        wait_for(lambda: holds(len(events)), proc, 120, "the second half, while following")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "(--bootstrap)" in err
    assert out.startswith(f"exported {len(events)} metrics events")


def test_export_metrics_reads_metrics_jsonl_when_no_broker_answers(tmp_path):
    cfg = _config(tmp_path, bootstrap=f"127.0.0.1:{free_port()}")
    events = _events(cfg.run.id)
    log = MetricsLog(metrics_path(cfg.run_dir))
    log.extend(events)
    log.close()
    config = _write_config(cfg, tmp_path / "config.yaml")

    proc = _cli(
        "export-metrics", str(config), "--run-id", cfg.run.id, "--to", "tensorboard", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from file {metrics_path(cfg.run_dir)} (no reachable broker)" in proc.stderr
    assert _tensorboard(cfg.run_dir / "tensorboard") == _expected(events)

    # --from-file reads any metrics file, the config's broker is not even looked at
    other = _config(tmp_path / "other")
    proc = _cli(
        "export-metrics",
        "--run-id",
        other.run.id,
        "--runs-dir",
        other.run.dir,
        "--from-file",
        str(metrics_path(cfg.run_dir)),
        "--to",
        "tensorboard",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _tensorboard(other.run_dir / "tensorboard") == _expected(events)


# -- bad input ---------------------------------------------------------------------------------


def test_an_unknown_exporter_is_refused_with_the_known_ones(tmp_path):
    cfg = _config(tmp_path)
    proc = _cli(
        "export-metrics",
        "--run-id",
        cfg.run.id,
        "--runs-dir",
        cfg.run.dir,
        "--to",
        "tensorbord",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "unknown exporter 'tensorbord'; known: tensorboard, wandb, mlflow" in proc.stderr


def test_an_exporter_named_without_its_package_says_what_to_install(tmp_path):
    cfg = _config(tmp_path)
    log = MetricsLog(metrics_path(cfg.run_dir))
    log.extend(_events(cfg.run.id))
    log.close()
    # a process in which `import wandb` fails as if it were not installed (Python's own way
    # to block an import: a None entry in sys.modules)
    proc = _cli(
        "export-metrics",
        "--run-id",
        cfg.run.id,
        "--runs-dir",
        cfg.run.dir,
        "--to",
        "tensorboard",
        "--to",
        "wandb",
        cwd=tmp_path,
        pre="import sys; sys.modules['wandb'] = None",
    )
    assert proc.returncode == 2, proc.stderr
    assert "monitor.exporters: wandb needs the 'wandb' package: `pip install wandb`" in proc.stderr
    assert not (cfg.run_dir / "tensorboard").exists()  # refused before anything was written


def test_a_run_without_metrics_is_an_error_and_leaves_no_empty_runs(make_config, tmp_path):
    cfg = make_config()
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    config = _write_config(cfg, tmp_path / "config.yaml")
    proc = _cli(
        "export-metrics",
        str(config),
        "--run-id",
        cfg.run.id,
        "--to",
        "mlflow",
        "--to",
        "wandb",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert f"no metrics events in topic {cfg.topics().metrics}" in proc.stderr
    assert not (cfg.run_dir / "mlruns").exists() and not (cfg.run_dir / "wandb").exists()

    # a run id with neither a topic nor a metrics.jsonl
    proc = _cli(
        "export-metrics",
        str(config),
        "--run-id",
        "no-such-run",
        "--to",
        "tensorboard",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "has no topic" in proc.stderr and "metrics.jsonl does not exist" in proc.stderr


def test_an_installed_tensorboard_that_does_not_import_is_skipped_unless_named(tmp_path):
    cfg = _config(
        tmp_path,
        bootstrap=f"127.0.0.1:{free_port()}",
        exporters=["tensorboard", "mlflow"],
        mlflow={"experiment": "exporters-broken"},
    )
    events = _events(cfg.run.id)
    log = MetricsLog(metrics_path(cfg.run_dir))
    log.extend(events)
    log.close()
    config = _write_config(cfg, tmp_path / "config.yaml")
    # tensorboard is installed, but a module of it fails to import (as with a protobuf
    # conflict): the default exporters go on without it, with a warning
    broken = "import sys; sys.modules['tensorboard.summary.writer.event_file_writer'] = None"
    proc = _cli("export-metrics", str(config), "--run-id", cfg.run.id, cwd=tmp_path, pre=broken)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "monitor.exporters: tensorboard skipped" in proc.stderr
    assert "event_file_writer" in proc.stderr
    assert not (cfg.run_dir / "tensorboard").exists()
    assert _mlflow(cfg) == _expected(events)

    # named on the command line, it is an error naming the package and why
    proc = _cli(
        "export-metrics",
        str(config),
        "--run-id",
        cfg.run.id,
        "--to",
        "tensorboard",
        cwd=tmp_path,
        pre=broken,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "monitor.exporters: tensorboard: the 'tensorboard' package is installed but" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_an_mlflow_server_that_is_down_is_a_clear_error(tmp_path):
    cfg = _config(tmp_path, bootstrap=f"127.0.0.1:{free_port()}")
    log = MetricsLog(metrics_path(cfg.run_dir))
    log.extend(_events(cfg.run.id))
    log.close()
    config = _write_config(cfg, tmp_path / "config.yaml")
    proc = _cli(
        "export-metrics",
        str(config),
        "--run-id",
        cfg.run.id,
        "--to",
        "mlflow",
        "-o",
        "monitor.mlflow.tracking_uri=http://127.0.0.1:9",  # nothing listens: refused
        cwd=tmp_path,
        # seconds with MLflow's retries capped; its own defaults retry for about 4 minutes
        timeout=150,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "streamrft: error: monitor.mlflow.tracking_uri: no MLflow run at http://127.0.0.1:9" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_an_mlflow_error_while_logging_is_a_service_error(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = _config(tmp_path, mlflow={"experiment": "exporters-lost"})
    (exporter,) = open_exporters(cfg, ["mlflow"], strict=True)
    for ev in _events(cfg.run.id):
        exporter.write(ev)
    MlflowClient(tracking_uri(cfg)).delete_run(exporter.run_id)  # gone while exporting
    with pytest.raises(ServiceError, match=r"monitor.mlflow.tracking_uri: logging \d+ metrics to"):
        exporter.flush()
    with pytest.raises(ServiceError, match=r"monitor\.mlflow\.tracking_uri: logging"):
        exporter.close()  # the values still to log, then the run to finish: neither can be
    exporter.close()  # closed already: nothing more


def test_export_metrics_finds_the_broker_of_infra_up_in_dir(services, make_config, tmp_path):
    cfg = make_config()
    asyncio.run(admin.ensure_topics(cfg.kafka, cfg.topics()))
    events = _events(cfg.run.id)
    asyncio.run(_publish(cfg, events))
    # the record `streamrft infra up` leaves in its state folder, naming the session broker
    # (a live process, its port open)
    infra = tmp_path / "elsewhere"
    infra.mkdir()
    port = int(services.bootstrap_servers.rpartition(":")[2])
    state = {
        "version": 1,
        "endpoints": {"bootstrap_servers": services.bootstrap_servers, "s3_endpoint": None},
        "services": {"kafka": {"pid": os.getpid(), "start_time": None, "port": port}},
    }
    (infra / "services.json").write_text(json.dumps(state))
    args = ("export-metrics", "--run-id", cfg.run.id, "--runs-dir", cfg.run.dir, "--to")
    proc = _cli(*args, "tensorboard", "--dir", str(infra), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(`streamrft infra up` in {infra})" in proc.stderr
    assert _tensorboard(cfg.run_dir / "tensorboard") == _expected(events)
