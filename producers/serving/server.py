"""The serve process: engine, version following, recording and publication around the API.

One engine call at a time (:attr:`Server.lock`): a new version is applied while the lock is
held, so it lands between two calls and never inside one, and every response carries the
version that sampled all of it. Rewarded groups are published by ``/commit``, or by the
flush loop (``serve.group_size``, ``serve.group_timeout_s``), in batches of
:data:`PUBLISH_BATCH` groups, each tried for ``serve.publish_attempt_s``. A batch the broker
did not take goes to the spool on disk (:mod:`.spool`), and until a publication succeeds
again new batches go there without a try; the flush loop publishes the spool's files
oldest first (this process's, and those an earlier or another serve process of the run
left). Past ``serve.spool_max_bytes``, or when the spool's disk refuses a file (full,
read-only, no permission: any ``OSError``), the groups wait in memory, the flush loop tries
them again every second, and completions and commits get 503. A stop publishes or spools
every rewarded response still held, within ``serve.shutdown_timeout_s`` of the signal, and
counts in ``groups_lost`` what it could do neither with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from streamrft.infra.bus import ControlView, Counters, EventSender, Position
from streamrft.infra.config import Config
from streamrft.infra.net import is_loopback
from streamrft.infra.produce import send_groups
from streamrft.infra.signals import install_stop_handlers
from streamrft.infra.web_server import listening_socket, quiet_server
from streamrft.producers.engines.base import Rollout
from streamrft.producers.policy import followed_policy, start_sampler
from streamrft.producers.serving.api import Delivery
from streamrft.producers.serving.batcher import Batcher, Sampling, engine_call
from streamrft.producers.serving.recorder import Recorder
from streamrft.producers.serving.spool import Spool, SpoolFull, Taken
from streamrft.schemas.errors import ConfigError, StreamRFTError
from streamrft.schemas.events import RunState
from streamrft.schemas.experience import ExperienceGroup

log = logging.getLogger(__name__)

FLUSH_S = 1.0
"""How often due groups are published and versions looked for."""
PUBLISH_BATCH = 64
"""Groups per publication attempt, and per spool file."""
CLOSE_MIN_S = 2.0
"""After a stop, time to close the Kafka clients, at least (see :meth:`Server._close`)."""
CANCEL_STEP_S = 0.2
"""Past that, how long each wait of the closing clients is given before it is cancelled."""
STAGED_POLL_S = 0.05
"""How often serve mode looks whether the version received in the background is staged."""
SPOOL_NOTES_KEPT = 64
"""Distinct spool errors logged at most (each once: a disk that stays full is not logged
every second); past it the record starts again."""


def spool_folder(cfg: Config) -> Path:
    """``serve.spool_dir``, or ``<run dir>/serve/spool``."""
    return Path(cfg.serve.spool_dir) if cfg.serve.spool_dir else cfg.run_dir / "serve" / "spool"


def server_identity() -> str:
    """``serve-<pid>-<16 hex>``: unique among the serve processes of a run, and across
    restarts (a restarted server's group ids must never repeat an earlier one's)."""
    return f"serve-{os.getpid()}-{secrets.token_hex(8)}"


def api_key(cfg: Config) -> str | None:
    """The API key from ``serve.api_key_env``; ConfigError when a non-loopback address
    would be served without one."""
    key = os.environ.get(cfg.serve.api_key_env) or None
    if key is None and not is_loopback(cfg.serve.host):
        raise ConfigError(
            f"serve.host: {cfg.serve.host!r} is reachable from other machines; set an API key "
            f"in ${cfg.serve.api_key_env} (serve.api_key_env) or bind 127.0.0.1"
        )
    return key


class Server:
    """Everything the API handlers use: see the module docstring."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.name = server_identity()
        self.topics = cfg.topics()
        self.model_name = cfg.serve.model_name or str(cfg.run.id)
        self.limits = cfg.serve
        self.temperature = cfg.explorer.temperature
        self.corrected = cfg.algorithm.off_policy_correction != "none"
        self.stop = asyncio.Event()
        self.counters = Counters()
        self.events = EventSender(cfg, self.name, "serve", self.counters, self._position)
        self.view = ControlView(cfg, self.name, self.events.dead_letter)
        policy = followed_policy(cfg, self.name, self.view, self.events, self.counters, self.stop)
        self.engine, self.tokenizer = policy.engine, policy.tokenizer
        self.prompts, self.follower = policy.prompts, policy.follower
        self.context = getattr(self.engine.model.config, "max_position_embeddings", None)
        self.recorder = Recorder(
            self.topics.run,
            self.name,
            cfg.serve.group_size,
            cfg.serve.max_recorded,
            cfg.kafka.max_request_bytes // 2,
            cfg.serve.max_recorded_tokens,
        )
        self.lock = asyncio.Lock()
        self.batcher = Batcher(self._call, cfg.serve.max_batch)
        folder = spool_folder(cfg)
        try:
            self.spool = Spool(folder, cfg.serve.spool_max_bytes, self.name)
        except OSError as exc:
            raise ConfigError(f"serve.spool_dir: cannot keep the spool in {folder}: {exc}") from exc
        self.held_back: list[ExperienceGroup] = []
        """Groups neither published nor spooled (the spool was full, or its disk refused
        the file), tried again by the flush loop; while any wait, completions and commits
        get 503."""
        self.spool_trouble = f"the spool is full (serve.spool_max_bytes={self.spool.max_bytes})"
        """Why the last batch that failed to publish could not be spooled either."""
        self._undeleted: list[Taken] = []
        """Spool files published whose deletion failed: still held (no serve process
        takes them), deleted again before another file is taken."""
        self._spool_noted: set[str] = set()
        self.outage = False
        """The last publication attempt failed: new batches go to the spool without a try
        until the flush loop publishes one again."""
        self.producer: Any = None
        self._spool_gauge()

    def _position(self) -> Position:
        """``working`` while responses wait for a reward or commit, or groups to be
        published: the trainer's idle timeout does not run out meanwhile."""
        waiting = bool(self.recorder.held or self.held_back or self.counters.get("spool_bytes"))
        return Position(step=0, version=self.version, working=waiting, ready=self.version >= 0)

    @property
    def version(self) -> int:
        """The version the engine holds (-1: none yet; 0 with ``serve.serve_initial``)."""
        held = self.follower.version
        return 0 if held < 0 and self.cfg.serve.serve_initial else held

    # -- what the handlers call --------------------------------------------------------------
    async def sample(
        self, prompt_ids: list[int], sampling: Sampling, seed: int
    ) -> tuple[list[Rollout], int]:
        """``sampling.n`` rollouts of one prompt and the version that sampled them all
        (batched with concurrent requests: :mod:`.batcher`)."""
        rollouts, version = await self.batcher.sample(prompt_ids, sampling, seed)
        self.counters.add("completions")
        self.counters.add("choices", sampling.n)
        return rollouts, version

    async def _call(
        self, prompts: list[list[int]], sampling: Sampling, seed: int
    ) -> tuple[list[list[Rollout]], int]:
        """One engine call, under the lock a version swap takes."""
        async with self.lock:
            version = self.version
            batches = await asyncio.to_thread(engine_call, self.engine, prompts, sampling, seed)
        return batches, version

    async def publish(self, groups: list[ExperienceGroup]) -> Delivery:
        """Publish ``groups``, or spool what the broker does not take (see the module
        docstring); what neither takes is held for the flush loop."""
        delivery = await self._deliver(groups)
        self.held_back += delivery.held
        return delivery

    def refusal(self) -> str | None:
        """Why completions and commits get 503 now: groups wait in memory (the spool was
        full, or its disk refused them, when they failed), or the spool is full."""
        if self.held_back:
            return (
                f"the broker is unreachable and {self.spool_trouble}; {len(self.held_back)} "
                f"groups wait in memory. Try again once the broker is back"
            )
        if self.counters.get("spool_bytes") >= self.spool.max_bytes:
            return f"the spool is full (serve.spool_max_bytes={self.spool.max_bytes})"
        return None

    # -- publication -------------------------------------------------------------------------
    async def _deliver(
        self, groups: list[ExperienceGroup], deadline: float | None = None, probe: bool = False
    ) -> Delivery:
        """Each batch of ``groups`` published, else spooled, else held. A batch is not
        tried in an outage (:attr:`outage`; with ``probe`` the first is), nor when a try
        would not end before ``deadline`` (a loop time)."""
        out = Delivery()
        loop = asyncio.get_running_loop()
        attempt_s = self.cfg.serve.publish_attempt_s
        for start in range(0, len(groups), PUBLISH_BATCH):
            batch = groups[start : start + PUBLISH_BATCH]
            in_time = deadline is None or loop.time() + attempt_s <= deadline
            if (probe or not self.outage) and in_time and await self._send(batch):
                out.published += batch
                continue
            probe = False
            try:
                await asyncio.to_thread(self.spool.put, batch)
            except (SpoolFull, OSError) as exc:  # full, or its disk refuses: kept in memory
                if isinstance(exc, SpoolFull):
                    self.spool_trouble = f"the spool is full ({exc})"
                else:
                    self.counters.add("spool_errors")
                    self.spool_trouble = f"the spool cannot be written ({exc})"
                log.error("%s: %d groups not published nor spooled: %s", self.name, len(batch), exc)
                out.held += batch
                continue
            self.counters.add("groups_spooled", len(batch))
            out.spooled += batch
        if out.spooled or out.held:
            self._spool_gauge()
        return out

    async def _send(self, groups: list[ExperienceGroup]) -> bool:
        """One try (``serve.publish_attempt_s``) to publish ``groups`` (acks=all): whether
        the broker acknowledged them all. Sets or clears :attr:`outage`."""
        try:
            await send_groups(
                self.producer,
                self.topics.experiences,
                groups,
                self.name,
                self.cfg.serve.publish_attempt_s,
                lambda _exc: self.counters.add("publish_retries"),
            )
        except StreamRFTError as exc:
            if not self.outage:
                log.warning("%s: publication failed, spooling until it works: %s", self.name, exc)
            self.outage = True
            return False
        if self.outage:
            log.info("%s: publication works again", self.name)
        self.outage = False
        self.counters.add("groups_published", len(groups))
        self.counters.add("experiences_published", sum(len(g.experiences) for g in groups))
        return True

    async def _drain(self) -> bool:
        """Publish the spool's files oldest first, each deleted once its groups are
        acknowledged; up to the first that fails (then False), or the stop. A file the disk
        does not let it read is left for later (logged), and one published but not deleted
        is held until it is: nothing else is taken meanwhile."""
        self._undeleted = [t for t in self._undeleted if not await self._delete(t)]
        if self._undeleted:
            return True
        try:
            paths = await asyncio.to_thread(self.spool.pending)
        except OSError as exc:
            self._note_spool_error(exc)
            return True
        for path in paths:
            if self.stop.is_set():
                return True
            try:
                taken = await asyncio.to_thread(self.spool.take, path)
            except OSError as exc:  # this file unreadable: the others may not be
                self._note_spool_error(exc)
                continue
            if taken is None:  # another server's, published meanwhile, or set aside
                continue
            sent = False
            try:
                sent = await self._send(taken.groups)
            finally:
                if not sent:
                    await asyncio.to_thread(self.spool.release, taken)
            if not sent:
                return False
            log.info(
                "%s: published %d spooled groups (%s)", self.name, len(taken.groups), path.name
            )
            if not await self._delete(taken):
                self._undeleted.append(taken)
                return True
            self._spool_gauge()
        return True

    async def _delete(self, taken: Taken) -> bool:
        """Delete a spool file whose groups are published; whether it is gone (if not it
        stays held: see :meth:`.Spool.done`)."""
        try:
            await asyncio.to_thread(self.spool.done, taken)
        except OSError as exc:
            self.counters.add("spool_errors")
            self._note_spool_error(exc, f"{taken.path.name} is published but not deleted")
            return False
        return True

    def _note_spool_error(self, exc: OSError, what: str = "") -> None:
        """Log a spool error the first time it is seen (the flush loop meets it every
        second while the disk stays so)."""
        text = f"{what}: {exc}" if what else str(exc)
        if text in self._spool_noted:
            return
        if len(self._spool_noted) >= SPOOL_NOTES_KEPT:
            self._spool_noted.clear()
        self._spool_noted.add(text)
        log.error(
            "%s: spool %s: %s (tried again every %.0f s)",
            self.name,
            self.spool.folder,
            text,
            FLUSH_S,
        )

    def _spool_gauge(self) -> None:
        try:
            self.counters.set("spool_bytes", self.spool.size())
        except OSError as exc:  # the folder unreadable: the gauge keeps its last value
            self._note_spool_error(exc)

    # -- background loops --------------------------------------------------------------------
    async def _follow(self) -> None:
        """Apply each newer version between two engine calls: received in the background
        into the staging copy while requests are served (``synchronizer.staging``), then
        applied under the lock (requests wait for the swap: the apply, or with ``staging:
        none`` the receive and the apply)."""
        while not self.stop.is_set():
            newer = await self.view.wait_until(
                lambda: self.follower.newest() > self.follower.version,
                math.inf,
                self.stop,
                "a newer version",
            )
            if not newer:  # stopping, or the run shut down: serve on with what is held
                if self.view.shutdown.is_set():
                    log.info("%s: the run shut down; serving version %d", self.name, self.version)
                return
            # staged in the background while requests are served: the receive under way
            # now, not the next ones (versions may come faster than one is received)
            under_way = self.follower.receiving()
            while under_way is not None and self.follower.receiving() == under_way:
                if self.stop.is_set():
                    break
                await self._pause(STAGED_POLL_S)
            async with self.lock:
                if not await self.follower.apply_newest():
                    return
            if self.follower.newest() > self.follower.version:  # the store is down: later
                await self._pause(FLUSH_S)
            elif self.events.state != RunState.RUNNING:
                await self.events.status(RunState.RUNNING, f"version {self.version}")

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    async def _flush(self) -> None:
        """Publish the spool's files, then the groups held in memory, then the groups that
        are due (left with the recorder while groups are held)."""
        serve = self.cfg.serve
        while not self.stop.is_set():
            await self._pause(FLUSH_S)
            failed = not await self._drain()
            if self.stop.is_set():
                return
            if self.held_back:  # tried even in an outage, unless the spool's file just failed
                held, self.held_back = self.held_back, []
                self.held_back += (await self._deliver(held, probe=not failed)).held
            if not self.held_back:
                now = time.time()
                await self.publish(
                    self.recorder.ready(now, serve.group_timeout_s, serve.unrewarded_ttl_s)
                )
            self._spool_gauge()

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self, app: Any, key: str | None) -> None:
        """Serve until SIGINT/SIGTERM (or a background loop fails), then publish what is
        rewarded and stop."""
        # connections wait in the backlog from the moment the URL is written
        serve = self.cfg.serve
        sock = listening_socket(serve.host, serve.port, "set serve.port (0: a free port)", 2048)
        port = sock.getsockname()[1]
        # accepted connections inherit it: a response's head and body go out at once rather
        # than the body waiting ~40 ms for the client's delayed ACK (Nagle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        install_stop_handlers(self.stop, self.name)
        stack = contextlib.AsyncExitStack()
        deadline: float | None = None
        try:
            await self._start(stack)
            host = serve.host
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            stack.callback(self._announce(url, key is not None))
            # beyond max_concurrency: 503 at once
            http = quiet_server(
                app, serve.shutdown_timeout_s, limit_concurrency=serve.max_concurrency
            )
            loops = [
                asyncio.create_task(self._follow(), name="the version follower"),
                asyncio.create_task(self._flush(), name="the publisher"),
            ]
            for loop in loops:
                loop.add_done_callback(self._loop_ended)
            log.info("%s: serving %s at %s/v1", self.name, self.model_name, url)
            serving = asyncio.create_task(http.serve(sockets=[sock]))
            await self.stop.wait()
            deadline = asyncio.get_running_loop().time() + serve.shutdown_timeout_s
            http.should_exit = True  # finishes the requests in flight, then returns
            await serving
            await asyncio.gather(*loops, return_exceptions=True)
            await self.batcher.close()
            await self._final_publish(deadline)
        finally:
            await self._close(stack, deadline)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A background loop that fails stops the server (loudly), rather than leaving it
        answering on a version it no longer follows."""
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "%s: %s failed; stopping", self.name, task.get_name(), exc_info=task.exception()
            )
            self.stop.set()

    async def _final_publish(self, deadline: float) -> None:
        """Publish every rewarded group still held, batch by batch while a try still ends
        before ``deadline``; spool the rest (the next serve process of the run publishes
        it)."""
        groups = self.held_back + self.recorder.commit(time.time())
        self.held_back = []
        delivery = await self._deliver(groups, deadline)
        if delivery.spooled:
            log.warning(
                "%s: %d groups wait in the spool %s for the next serve process of this run",
                self.name,
                len(delivery.spooled),
                self.spool.folder,
            )
        if delivery.held:
            self.counters.add("groups_lost", len(delivery.held))
            log.error(
                "%s: %d groups lost: the broker is unreachable and %s",
                self.name,
                len(delivery.held),
                self.spool_trouble,
            )
        self._undeleted = [t for t in self._undeleted if not await self._delete(t)]
        for taken in self._undeleted:  # the next serve process publishes them again
            log.warning(
                "%s: %s was published but could not be deleted: the next serve process of "
                "the run publishes its %d groups again (the trainer's dedup window drops the "
                "repeats)",
                self.name,
                taken.path.name,
                len(taken.groups),
            )
            self.spool.release(taken)
        self._undeleted = []
        if self.recorder.held:
            log.info("%s: %d responses without a reward dropped", self.name, self.recorder.held)

    async def _close(self, stack: contextlib.AsyncExitStack, deadline: float | None) -> None:
        """Close what :meth:`_start` started (with a STOPPED status). After a stop, only
        until ``deadline`` (at least :data:`CLOSE_MIN_S`): a client that still waits for a
        broker that is away then has each wait cancelled in turn (a status event is what
        it may lose: every rewarded group is published or spooled before this)."""
        closing = asyncio.ensure_future(stack.aclose())
        if deadline is None:
            await closing
            return
        left = max(deadline - asyncio.get_running_loop().time(), CLOSE_MIN_S)
        await asyncio.wait({closing}, timeout=left)
        if not closing.done():
            log.warning("%s: the broker did not answer; closing its clients without it", self.name)
        while not closing.done():  # each cancel ends one wait; the later steps still run
            closing.cancel()
            await asyncio.wait({closing}, timeout=CANCEL_STEP_S)
        if not closing.cancelled():
            closing.result()

    def _announce(self, url: str, with_key: bool):
        """Write ``<run dir>/serve/<id>.json`` (how tests and tools find the URL); returns
        the callback that removes it."""
        path = Path(self.cfg.run_dir) / "serve" / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        info = {"url": url, "pid": os.getpid(), "server": self.name, "api_key": with_key}
        path.write_text(json.dumps(info))
        return lambda: path.unlink(missing_ok=True)

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        self.producer = await start_sampler(
            stack,
            self.cfg,
            self.name,
            self.events,
            self.view,
            self.follower,
            self.cfg.serve.publish_attempt_s,
        )
        self.follower.start_staging()  # versions are received in the background from now on
        waiting = self.version < 0
        state = RunState.WAITING_SYNC if waiting else RunState.RUNNING
        await self.events.status(state, "no model version yet" if waiting else "serving")


def main(cfg: Config) -> None:
    """``streamrft serve``: build the server and its API, serve until stopped."""
    from streamrft.producers.serving.api import build_app

    key = api_key(cfg)

    async def serve() -> None:
        server = Server(cfg)
        serve = cfg.serve
        app = build_app(
            server,
            key,
            bound=serve.host,
            hosts=serve.allowed_hosts,
            origins=serve.allowed_origins,
        )
        await server.run(app, key)

    asyncio.run(serve())
