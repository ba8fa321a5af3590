"""``streamrft run``: feeder, explorers and trainer as separate OS processes, one supervisor.

The supervisor resolves the config (run id, endpoints), starts the embedded broker and
object store when none is configured, creates the run's topics, spawns the children with
the resolved config file, shows progress from the metrics topic, and on Ctrl-C / SIGTERM
(or when the trainer ends) asks everyone to stop: a ``Shutdown`` control event, then
SIGTERM, then SIGKILL after a grace period. Nothing it started is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from streamrft.app.placement import check_gpu_shares, physical_device, placement, start_order
from streamrft.app.process import EXIT_CONFIG, EXIT_STALLED
from streamrft.app.resume import check_finished, check_resume, keep_summary
from streamrft.app.watch.curves import draw
from streamrft.app.watch.metric_sinks import (
    SinkWorker,
    close_sinks,
    open_samples_sink,
    open_sinks,
)
from streamrft.app.watch.metrics_log import iter_metrics, metrics_path
from streamrft.app.watch.monitor import RunMonitor
from streamrft.app.watch.run_probes import RunProbes
from streamrft.infra import admin
from streamrft.infra.bus import EventSender
from streamrft.infra.config import (
    Config,
    ObjectStoreConfig,
    credentials_env,
    for_s3_broker,
    to_yaml,
    with_endpoints,
    with_store_credentials,
)
from streamrft.infra.local.services import LocalServices
from streamrft.infra.logfiles import log_tail, rotate_all
from streamrft.infra.pids import port_open
from streamrft.infra.probes import ProbeServer
from streamrft.infra.signals import install_stop_handlers
from streamrft.schemas.errors import ServiceError, StreamRFTError
from streamrft.schemas.events import Shutdown

log = logging.getLogger(__name__)
STOP_GRACE_S = 20.0
ROTATE_EVERY_S = 10.0
"""How often the run's logs (its processes', the embedded services') are checked against
their size cap (:mod:`streamrft.infra.logfiles`)."""


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()

    def kill_after(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for it to exit (after ``terminate``), then kill it."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        self.kill()

    def tail(self, lines: int = 15) -> str:
        return "\n".join(log_tail(self.log_path).splitlines()[-lines:])


def child_env(threads: int, credentials: dict[str, str | None]) -> dict[str, str]:
    """The supervisor's environment, thread limits, and the run's credentials: the config
    file children load has its secrets redacted, so they travel here (None: removed)."""
    env = dict(os.environ)
    for var, value in credentials.items():
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", str(threads))
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _show(bar, m: RunMonitor) -> None:
    """Progress line: trainer step, newest sampled reward and eval accuracy (before the
    first step: what the trainer is doing, its SFT warm-up named)."""
    if bar is None:
        return
    bar.n = m.trainer_step
    bar.set_postfix_str(m.progress(), refresh=False)
    bar.refresh()


class Supervisor:
    def __init__(
        self, cfg: Config, summary_path: Path | None, progress: bool, dashboard: bool = False
    ) -> None:
        self.cfg = cfg
        self.summary_path = summary_path
        self.progress = progress and cfg.monitor.progress
        self.want_dashboard = dashboard
        self.dashboard: Child | None = None
        """``streamrft dashboard`` beside the run (``run --dashboard``): not a member of
        the run; its failure fails nothing, and it stops with the run."""
        self.children: dict[str, Child] = {}
        self.spawn_args: dict[str, tuple[list[str], int, Path]] = {}
        self.restarts: dict[str, int] = {}
        self.stop = asyncio.Event()
        self.services = None
        self.trainer_waits = False
        """``run.start_order`` explorers_first: the trainer is not started yet."""
        self.config_path: Path | None = None
        self.started_at = 0.0
        """Wall time the children were started: later statuses are this attempt's."""
        self.eval_failures: list[str] = []
        """Evaluators that failed after the trainer finished (the run itself succeeded)."""

    def _spawn(self, name: str, role_args: list[str], threads: int, config_path: Path) -> None:
        argv = [sys.executable, "-m", "streamrft.app.cli", *role_args, str(config_path)]
        log_path = self.cfg.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = child_env(threads, credentials_env(self.cfg))
        self.children[name] = Child(name, argv, log_path, env)
        self.spawn_args[name] = (role_args, threads, config_path)

    def _restart_or_fail(self, name: str, child: Child) -> str | None:
        """A process that died is started again, up to its role's ``max_restarts``: an
        explorer rejoins the tasks group and resyncs weights (its unacknowledged tasks are
        explored again); the trainer resumes from its latest checkpoint and seeks to the
        offsets stored in it. Anything else fails the run, and so does a child stopped by a
        configuration error (exit status ``EXIT_CONFIG``: an unknown engine, reward or
        algorithm name, LoRA targets the model lacks...), which no restart can mend.
        Returns the failure."""
        rc = child.returncode
        if rc == EXIT_CONFIG:
            return f"{name} stopped on a configuration error:\n{child.tail()}"
        if rc == EXIT_STALLED:
            return f"{name} stopped: nothing can make progress:\n{child.tail(3)}"
        limit = {"trainer": self.cfg.trainer.max_restarts}.get(
            name,
            self.cfg.explorer.max_restarts if name.startswith(("explorer-", "evaluator-")) else 0,
        )
        if self.restarts.get(name, 0) < limit:
            self.restarts[name] = self.restarts.get(name, 0) + 1
            log.warning(
                "%s exited with code %s; restart %d of %d\n%s",
                name,
                rc,
                self.restarts[name],
                limit,
                child.tail(5),
            )
            child.kill()
            self._spawn(name, *self.spawn_args[name])
            return None
        return f"{name} exited with code {rc}:\n{child.tail()}"

    def _bar(self):
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(
            total=self.cfg.trainer.max_steps or None,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )

    async def _run(self) -> dict:
        started = time.monotonic()
        signals = install_stop_handlers(self.stop, "supervisor", on_force=self._kill_all)
        # before anything starts (a missing exporter is an error); off the loop: an
        # exporter may reach a server
        sinks = await asyncio.to_thread(open_sinks, self.cfg)
        samples = await asyncio.to_thread(open_samples_sink, self.cfg)
        try:
            monitor, failure = await self._supervise(sinks, samples)
        finally:
            await asyncio.to_thread(close_sinks, [*sinks, samples])
        summary = monitor.summary(time.monotonic() - started)
        summary.update(after_run_files(self.cfg))
        summary["interrupted"] = self.stop.is_set()
        summary["signal"] = signals.received
        summary["exit_codes"] = {n: c.returncode for n, c in self.children.items()}
        summary["restarts"] = dict(self.restarts)
        summary["run_dir"] = str(self.cfg.run_dir)
        if failure:
            summary["failure"] = failure
        if self.eval_failures:
            summary["evaluation_failures"] = self.eval_failures
        return summary

    async def _supervise(self, sinks: list, samples: SinkWorker) -> tuple[RunMonitor, str | None]:
        """Topics and config, the monitor, the children until the run ends; then every
        child stopped and the monitor drained. Returns the monitor and the failure."""
        config_path = await self._prepare()
        monitor, bar = RunMonitor(self.cfg, sinks=sinks, samples=samples), self._bar()
        monitor_done = asyncio.Event()
        follow = asyncio.create_task(monitor.follow(monitor_done, lambda m: _show(bar, m)))
        failure = None
        probes = None
        try:
            if self.cfg.monitor.http_port:
                answers = RunProbes(monitor, follow, self.restarts, lambda: self.started_at)
                probes = ProbeServer(self.cfg.monitor, answers, "supervisor")
                await probes.start()
            if self.want_dashboard:
                await self._start_dashboard(config_path)
            if not self.stop.is_set():
                self._start_children(config_path)
                failure = await self._watch(follow, monitor)
        finally:
            await self._shutdown(failed=failure is not None)
            if probes is not None:
                await probes.stop()
            if self.dashboard is not None:
                self.dashboard.terminate()
                await asyncio.to_thread(self.dashboard.kill_after, 5)
            monitor_done.set()
            try:
                await asyncio.wait_for(follow, 30)
            except Exception as exc:  # the failure (if it ended the run) is reported already
                log.warning("the run monitor ended with %s: %s", type(exc).__name__, exc)
            if bar is not None:
                _show(bar, monitor)
                bar.close()
        return monitor, failure

    async def _prepare(self) -> Path:
        """The run's topics (tasks partitions for every explorer) and its resolved config
        file, which every child loads."""
        cfg = self.cfg
        if cfg.explorer.count > cfg.kafka.partitions:
            log.warning(
                "explorer.count %d > kafka.partitions %d: the tasks topic gets %d partitions, "
                "so that every explorer has one (an explorer started by hand on top idles)",
                cfg.explorer.count,
                cfg.kafka.partitions,
                admin.tasks_partitions(cfg.kafka, cfg.explorer.count),
            )
        created = await admin.ensure_topics(cfg.kafka, cfg.topics(), cfg.explorer.count)
        log.debug(
            "topics ready (%d created) under %s.%s.*",
            len(created),
            cfg.kafka.topic_prefix,
            cfg.run.id,
        )
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = cfg.run_dir / "config.yaml"
        # the children's: the run's probes are the supervisor's (monitor.http_port)
        children = msgspec.structs.replace(
            cfg, monitor=msgspec.structs.replace(cfg.monitor, http_port=0)
        )
        config_path.write_text(to_yaml(children))
        log.debug("resolved config written to %s", config_path)
        return config_path

    async def _start_dashboard(self, config_path: Path) -> None:
        """Start ``streamrft dashboard`` on this run and print its address (the configured
        port, or a free one when that is taken)."""
        port = self.cfg.monitor.dashboard_port
        if port and port_open(port):
            log.info("port %d is taken (another dashboard?): the dashboard takes a free one", port)
            port = 0
        url_file = self.cfg.run_dir / "dashboard.url"
        url_file.unlink(missing_ok=True)
        argv = [
            sys.executable, "-m", "streamrft.app.cli", "dashboard", str(config_path),
            "--run-id", str(self.cfg.run.id), "--port", str(port), "--url-file", str(url_file),
        ]  # fmt: skip
        log_path = self.cfg.run_dir / "logs" / "dashboard.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = child_env(1, credentials_env(self.cfg))
        self.dashboard = Child("dashboard", argv, log_path, env)
        deadline = time.monotonic() + 60
        while not url_file.exists() and self.dashboard.returncode is None:
            if time.monotonic() > deadline or self.stop.is_set():
                break
            await asyncio.sleep(0.2)
        if url_file.exists():
            log.info("dashboard: %s", url_file.read_text().strip())
        else:
            log.warning(
                "the dashboard did not start (log %s):\n%s", log_path, self.dashboard.tail(5)
            )

    def _start_children(self, config_path: Path) -> None:
        """Trainer, explorers, feeder; with ``explorers_first`` (``run.start_order``) the
        trainer waits in :meth:`_watch` until every explorer has built its engine."""
        cfg = self.cfg
        self.trainer_waits = start_order(cfg) == "explorers_first"
        self.started_at = time.time()
        if not self.trainer_waits:
            self._spawn("trainer", ["train"], cfg.trainer.threads, config_path)
        if not cfg.explorer.count:
            log.info(
                "no explorer started (explorer.count 0): start them with "
                "`streamrft explore CONFIG --run-id %s [--index I]`",
                cfg.run.id,
            )
        for i in range(cfg.explorer.count):
            role_args = ["explore", "--index", str(i)]
            self._spawn(f"explorer-{i}", role_args, cfg.explorer.threads, config_path)
        for i in range(cfg.eval.count):
            role_args = [
                "evaluate",
                "--index",
                str(i),
                "--attempt-started-at",
                f"{self.started_at}",
            ]
            self._spawn(f"evaluator-{i}", role_args, cfg.explorer.threads, config_path)
        self._spawn("feeder", ["feed"], 1, config_path)
        if self.trainer_waits:
            log.info("starting the trainer once the explorers have built their engines")
        self.config_path = config_path

    def _start_trainer_when_explorers_ready(self, monitor: RunMonitor) -> None:
        """Start the trainer once every explorer has reported since the run (re)started: a
        status sent after building its engine (a resumed run's topic still holds the
        previous attempt's statuses, which do not count)."""
        names = [f"explorer-{i}" for i in range(self.cfg.explorer.count)]
        names += [f"evaluator-{i}" for i in range(self.cfg.eval.count)]  # vLLM ones too
        statuses = [monitor.status.get(name) for name in names]
        if all(s is not None and s.created_at >= self.started_at for s in statuses):
            log.info("explorers ready (engines built): starting the trainer")
            assert self.config_path is not None  # set with the explorers
            self._spawn("trainer", ["train"], self.cfg.trainer.threads, self.config_path)
            self.trainer_waits = False

    async def _watch(self, follow: asyncio.Task[None], monitor: RunMonitor) -> str | None:
        """Until the trainer finishes, a signal stops the run, or a child fails for good
        (restarting the ones that may be restarted), capping the logs' sizes on the way.
        Returns the failure, if any."""
        logs = [self.cfg.run_dir / "logs", self.cfg.run_dir / "services" / "logs"]
        rotated_at = time.monotonic()
        while not self.stop.is_set():
            if time.monotonic() - rotated_at > ROTATE_EVERY_S:
                await asyncio.to_thread(rotate_all, logs)
                rotated_at = time.monotonic()
            if self.trainer_waits:
                self._start_trainer_when_explorers_ready(monitor)
            elif self.children["trainer"].returncode == 0:
                await self._let_evaluators_finish()
                return None  # the run is done
            for name, child in list(self.children.items()):
                if child.returncode not in (None, 0):
                    failure = self._restart_or_fail(name, child)
                    if failure:
                        return failure
            if follow.done():
                follow.result()  # surfaces a broker failure
            await asyncio.sleep(0.25)
        return None

    async def _let_evaluators_finish(self) -> None:
        """Wait (up to ``eval.final_timeout_s``) for the evaluators, which read the trainer's
        Shutdown, to evaluate the run's last version and stop on their own."""
        alive = [
            c
            for n, c in self.children.items()
            if n.startswith("evaluator-") and c.returncode is None
        ]
        if not alive:
            return
        limit = self.cfg.eval.final_timeout_s
        log.info("trainer done; the evaluators evaluate the last version (up to %.0f s)", limit)
        deadline = time.monotonic() + limit
        while any(c.returncode is None for c in alive) and not self.stop.is_set():
            if time.monotonic() > deadline:
                log.warning(
                    "the evaluators did not finish within eval.final_timeout_s %.0f s; "
                    "stopping them (the last version may not be evaluated)",
                    limit,
                )
                return
            await asyncio.sleep(0.25)
        for c in alive:
            if c.returncode not in (None, 0):  # training succeeded; its evaluation did not
                self.eval_failures.append(f"{c.name} exited with code {c.returncode}")
                log.warning("%s failed at the end of the run:\n%s", c.name, c.tail(5))

    def _kill_all(self) -> None:
        for child in self.children.values():
            child.kill()
        if self.dashboard is not None:
            self.dashboard.kill()

    async def _shutdown(self, failed: bool) -> None:
        """Shutdown event, wait for orderly exits, then SIGTERM, then SIGKILL. A run
        stopped by a signal, or failed (a child's configuration error, a child out of
        restarts), passes SIGTERM on to its children first, then sends the Shutdown event
        (for explorers started by hand): a child that stopped on the event alone would
        have left its event loop, and with it its signal handler, by the time a later
        SIGTERM arrived, and died of it mid-exit; and a sibling still building its engine
        reads no event, so a failed run would wait out the whole grace for it."""
        alive = [c for c in self.children.values() if c.returncode is None]
        if alive:
            if self.stop.is_set() or failed:
                for c in alive:
                    c.terminate()
            try:
                async with EventSender(self.cfg, "supervisor", "supervisor") as sender:
                    await sender.control(
                        Shutdown(reason="supervisor stopping the run", created_at=time.time())
                    )
            except StreamRFTError as exc:
                log.warning("could not send Shutdown (%s); signalling the processes", exc)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(
            c.returncode is None for c in self.children.values()
        ):
            await asyncio.sleep(0.2)
        for c in self.children.values():
            if c.returncode is None:
                c.terminate()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
            c.returncode is None for c in self.children.values()
        ):
            await asyncio.sleep(0.2)
        for c in self.children.values():
            if c.returncode is None:
                log.warning("%s did not stop; killing it", c.name)
            c.kill()

    def run(self) -> dict:
        return asyncio.run(self._run())


def header(cfg: Config, services: LocalServices | None) -> str:
    """The few lines the console shows when a run starts (the resolved config is in the run
    folder, and in the log at DEBUG)."""
    m = cfg.model
    model = (
        str(m.path) if m.source == "path" else f"tiny ({m.num_layers} layers, {m.hidden_size} wide)"
    )
    if m.lora.enabled:
        model += ", LoRA"
    broker_own = " (embedded)" if services is not None and services.broker else ""
    store_own = " (embedded)" if services is not None and services.object_store else ""
    steps = cfg.trainer.max_steps or "no step limit"
    return "\n".join(
        (
            f"run {cfg.run.id}",
            f"  services  broker {cfg.kafka.bootstrap_servers}{broker_own}, "
            f"object store {cfg.object_store.endpoint or 'none'}{store_own}",
            f"  model     {model}, {m.dtype}; explorer engine {cfg.explorer.engine}",
            f"  placement {'; '.join(f'{role} on {_here(d)}' for role, d, _ in placement(cfg))}",
            f"  training  {cfg.algorithm.type}, {steps} steps, {cfg.explorer.count} explorer(s), "
            f"sync {cfg.synchronizer.method} / {cfg.synchronizer.style}",
            f"  eval      {_eval_line(cfg)}",
            f"  files     {cfg.run_dir}/ (config.yaml, logs/, metrics.jsonl)",
            f"  watch     streamrft status --run-id {cfg.run.id}   |   "
            f"streamrft dashboard --run-id {cfg.run.id}",
        )
    )


def _here(device: str) -> str:
    """``device`` as the header shows it: ``auto`` with what it resolves to on this host
    (as ``streamrft validate`` says it)."""
    return f"auto: {physical_device(device)} here" if device == "auto" else device


def _eval_line(cfg: Config) -> str:
    e = cfg.eval
    where = []
    if e.count:
        where.append(f"{e.count} evaluator(s), every {e.every_versions}-th version")
    if e.trainer_evaluates:
        where.append(
            f"the trainer every {e.interval} step(s)"
            if e.interval
            else "the trainer, first and last step"
        )
    return "; ".join(where) or "none (eval.in_trainer false; start `streamrft evaluate`)"


def after_run_files(cfg: Config) -> dict:
    """The run's metrics file and its curves (drawn now, from the whole file), for the
    summary."""
    path = metrics_path(cfg.run_dir)
    files: dict = {"metrics_file": str(path), "curves": None}
    if not cfg.monitor.curves or not path.exists():
        return files
    try:
        curves = draw(
            iter_metrics(path, ledgers=False), cfg.run_dir / "curves.png", f"run {cfg.run.id}"
        )
    except (ImportError, OSError, ValueError) as exc:
        log.warning("curves not drawn: %s", exc)
        return files
    files["curves"] = str(curves) if curves else None
    return files


def start_embedded(cfg: Config) -> tuple[Config, LocalServices | None]:
    """Start the embedded broker and/or object store for what ``cfg`` names no endpoint of
    (see ``infra.endpoints`` for where one is looked for first); ``cfg`` pointed at them.

    They are recorded in ``<run dir>/services`` so that a hand-started explorer finds them.
    """
    need_broker = not cfg.kafka.bootstrap_servers
    need_store = not cfg.object_store.endpoint
    if not (need_broker or need_store):
        return cfg, None
    own_secret = cfg.object_store.secret_key != ObjectStoreConfig().secret_key
    services = LocalServices(
        cfg.run_dir / "services",
        broker=need_broker,
        object_store=need_store,
        access_key=cfg.object_store.access_key,
        # the public default is replaced by a secret generated for these services
        secret_key=cfg.object_store.secret_key if own_secret else None,
        broker_storage=cfg.kafka.embedded_storage if need_store else "memory",
    )
    eps = services.start()
    services.record()
    log.debug(
        "embedded services: broker %s, object store %s", eps.bootstrap_servers, eps.s3_endpoint
    )
    cfg = with_endpoints(cfg, eps.bootstrap_servers, eps.s3_endpoint)
    if need_store:  # the children get them in their environment (child_env)
        cfg = with_store_credentials(cfg, eps.access_key, eps.secret_key)
    if services.broker and services.broker_storage == "s3":
        cfg = for_s3_broker(cfg)
    return cfg, services


def run_with_services(
    cfg: Config,
    summary_path: Path | None,
    progress: bool = True,
    dashboard: bool = False,
    resume: bool = False,
) -> dict:
    """Check a resume (a finished run only with ``resume``), start embedded services where
    needed, run (with ``dashboard``, the dashboard beside it), write the summary (a
    finished run's earlier one kept beside it)."""
    check_gpu_shares(cfg)
    # before anything starts: a refused resume changes nothing
    finished = check_finished(cfg, resume)
    if check_resume(cfg):
        log.info(
            "run %s exists in %s: resuming it%s",
            cfg.run.id,
            cfg.run_dir,
            f" (finished at step {finished.step}; trained on to step {cfg.trainer.max_steps})"
            if finished is not None
            else "",
        )
    cfg, services = start_embedded(cfg)
    log.info("%s", header(cfg, services))
    try:
        summary = Supervisor(cfg, summary_path, progress, dashboard).run()
    finally:
        if services is not None:
            services.stop()
    if summary_path is not None:
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        kept = keep_summary(summary_path) if finished is not None else None
        if kept is not None:
            log.info("the summary of the run as it had finished is kept as %s", kept)
        summary_path.write_text(json.dumps(summary, indent=2))
    if summary.get("failure"):
        raise ServiceError(summary["failure"])
    return summary
