"""``streamrft`` command lines for the tests that run it as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from streamrft.infra.local.services import Endpoints


def streamrft_cmd(*args: str) -> list[str]:
    """``streamrft ARGS`` run by this interpreter (so the package installed beside it)."""
    return [sys.executable, "-m", "streamrft.app.cli", *args]


def env() -> dict[str, str]:
    """This process's environment for a ``streamrft`` child: one thread per torch op (the
    machine has few cores and several processes), no tokenizer threads."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_ok(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``argv`` (a ``streamrft`` command line) to its end in ``cwd`` with :func:`env`,
    output captured; fails the test with the end of its stderr unless it exits 0."""
    proc = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def start_piped(argv: list[str], cwd: Path) -> subprocess.Popen:
    """Start ``argv`` in ``cwd`` with :func:`env`, stdout and stderr piped as text (read
    them with ``communicate``)."""
    return subprocess.Popen(
        argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
    )


def start_logged(argv: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    """Start ``argv`` in ``cwd`` with :func:`env`, stdout and stderr into the file ``log``."""
    with log.open("w") as out:
        return subprocess.Popen(argv, env=env(), stdout=out, stderr=subprocess.STDOUT, cwd=cwd)


def overrides(*settings: str) -> list[str]:
    """``-o KEY=VALUE`` for each of ``settings``."""
    return [arg for setting in settings for arg in ("-o", setting)]


def service_overrides(services: Endpoints) -> list[str]:
    """The overrides that point a process at ``services``: the broker, the object store
    and its keys (a run given them starts no services of its own)."""
    return overrides(
        f"kafka.bootstrap_servers={services.bootstrap_servers}",
        f"object_store.endpoint={services.s3_endpoint}",
        f"object_store.access_key={services.access_key}",
        f"object_store.secret_key={services.secret_key}",
    )


def _common(
    run_id: str | None, runs_dir: Path, services: Endpoints | None, settings: tuple[str, ...]
) -> list[str]:
    run = ["--run-id", run_id] if run_id is not None else []
    on = service_overrides(services) if services is not None else []
    return [*run, *overrides(f"run.dir={runs_dir}", *settings), *on]


def run_argv(
    config: Path,
    run_id: str | None,
    steps: int,
    runs_dir: Path,
    services: Endpoints | None,
    *settings: str,
    explorers: int | None = None,
    summary: Path | None = None,
) -> list[str]:
    """``streamrft run CONFIG --max-steps STEPS --no-progress -o run.dir=RUNS_DIR`` with
    ``-o`` for each of ``settings`` (``"eval.interval=0"``...).

    ``run_id`` None: the run names itself. ``services`` None: the run starts its own broker
    and object store (unless ``settings`` name some). ``explorers``: ``--explorers N``;
    ``summary``: ``--summary PATH``.
    """
    args = ["run", str(config), "--max-steps", str(steps), "--no-progress"]
    if explorers is not None:
        args += ["--explorers", str(explorers)]
    if summary is not None:
        args += ["--summary", str(summary)]
    return streamrft_cmd(*args, *_common(run_id, runs_dir, services, settings))


def explore_argv(
    config: Path,
    run_id: str,
    runs_dir: Path,
    services: Endpoints | None,
    *settings: str,
    index: int | None = None,
) -> list[str]:
    """``streamrft explore CONFIG --run-id RUN_ID -o run.dir=RUNS_DIR``: one explorer that
    joins run ``run_id``, with ``-o`` for each of ``settings``. ``services`` None: it finds
    the run's services in the run folder. ``index``: ``--index N`` (else a unique id)."""
    args = ["explore", str(config)]
    if index is not None:
        args += ["--index", str(index)]
    return streamrft_cmd(*args, *_common(run_id, runs_dir, services, settings))


def style_settings(style: str, interval: int, offset: int, staleness: int) -> list[str]:
    """The settings of a short run under sync style ``style`` (no warm-up, evaluation or
    checkpoints; batches of 8 groups): the sync-style tests' runs."""
    return [
        f"synchronizer.style={style}",
        f"synchronizer.sync_interval={interval}",
        f"synchronizer.sync_offset={offset}",
        f"trainer.max_staleness={staleness}",
        "trainer.warmup_sft_steps=0",
        "eval.interval=0",
        "trainer.save_interval=0",
        "explorer.batch_size=8",
        "trainer.batch_size=8",
    ]
