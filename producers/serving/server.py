"""The serve process: engine, version following, recording and publication around the API.

One engine call at a time (:attr:`Server.lock`): a new version is applied while the lock is
held, so it lands between two calls and never inside one, and every response carries the
version that sampled all of it. Rewarded groups are published by ``/commit``, or by the
flush loop (``serve.group_size``, ``serve.group_timeout_s``); a publication that fails
(broker away past ``run.outage_timeout_s``) keeps its groups and retries them, and an orderly
stop publishes every rewarded response still held.
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
from streamrft.infra.config import Config, ServeConfig
from streamrft.infra.net import is_loopback
from streamrft.infra.produce import send_groups
from streamrft.infra.signals import install_stop_handlers
from streamrft.producers.engines.base import Rollout
from streamrft.producers.policy import followed_policy, start_sampler
from streamrft.producers.serving.batcher import Batcher
from streamrft.producers.serving.recorder import Recorder
from streamrft.schemas.errors import ConfigError, StreamRFTError
from streamrft.schemas.events import RunState
from streamrft.schemas.experience import ExperienceGroup

log = logging.getLogger(__name__)

FLUSH_S = 1.0
"""How often due groups are published and versions looked for."""


def _http_server(app: Any, serve: ServeConfig) -> Any:
    """A uvicorn server that leaves signals alone: this process's stop handlers set
    :attr:`Server.stop`, and the server is told to exit from there (uvicorn's own
    handling would re-raise the signal after serving and skip the final publication)."""
    import uvicorn

    class Quiet(uvicorn.Server):
        def capture_signals(self) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        access_log=False,
        limit_concurrency=serve.max_concurrency,  # beyond it: 503 at once
        timeout_graceful_shutdown=serve.shutdown_timeout_s,
    )
    return Quiet(config)


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
        self.unpublished: list[ExperienceGroup] = []
        """Groups whose publication failed; sent again by the flush loop."""
        self.producer: Any = None

    def _position(self) -> Position:
        return Position(step=0, version=self.version)

    @property
    def version(self) -> int:
        """The version the engine holds (-1: none yet; 0 with ``serve.serve_initial``)."""
        held = self.follower.version
        return 0 if held < 0 and self.cfg.serve.serve_initial else held

    # -- what the handlers call --------------------------------------------------------------
    async def sample(
        self, prompt_ids: list[int], n: int, temperature: float, max_tokens: int, seed: int
    ) -> tuple[list[Rollout], int]:
        """``n`` rollouts of one prompt and the version that sampled them all (batched
        with concurrent requests: :mod:`.batcher`)."""
        rollouts, version = await self.batcher.sample(prompt_ids, n, temperature, max_tokens, seed)
        self.counters.add("completions")
        self.counters.add("choices", n)
        return rollouts, version

    async def _call(
        self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int, seed: int
    ) -> tuple[list[list[Rollout]], int]:
        """One engine call, under the lock a version swap takes."""
        async with self.lock:
            version = self.version
            batches = await asyncio.to_thread(
                self.engine.rollout, prompts, n, temperature, max_tokens, seed
            )
        return batches, version

    async def publish(self, groups: list[ExperienceGroup]) -> None:
        """Publish ``groups`` (acks=all); on failure keep them for the flush loop and raise."""
        if not groups:
            return
        try:
            await send_groups(
                self.producer,
                self.topics.experiences,
                groups,
                self.name,
                self.cfg.run.outage_timeout_s,
                lambda _exc: self.counters.add("publish_retries"),
            )
        except StreamRFTError:
            self.unpublished += groups
            raise
        self.counters.add("groups_published", len(groups))
        self.counters.add("experiences_published", sum(len(g.experiences) for g in groups))

    # -- background loops --------------------------------------------------------------------
    async def _follow(self) -> None:
        """Apply each newer version between two engine calls (the lock is held while it is
        received and applied: requests wait for a swap)."""
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
        """Publish the groups that are due, and again those whose publication failed, one
        group at a time (one that fails does not hold up the others)."""
        serve = self.cfg.serve
        while not self.stop.is_set():
            await self._pause(FLUSH_S)
            due = self.recorder.ready(time.time(), serve.group_timeout_s, serve.unrewarded_ttl_s)
            retry, self.unpublished = self.unpublished, []
            for group in retry + due:
                try:
                    await self.publish([group])
                except StreamRFTError as exc:
                    log.warning("%s: publication failed, will retry: %s", self.name, exc)

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self, app: Any, key: str | None) -> None:
        """Serve until SIGINT/SIGTERM (or a background loop fails), then publish what is
        rewarded and stop."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.cfg.serve.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.serve.host, self.cfg.serve.port))
        port = sock.getsockname()[1]
        # accepted connections inherit it: a response's head and body go out at once rather
        # than the body waiting ~40 ms for the client's delayed ACK (Nagle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.listen(2048)  # connections wait in the backlog from the moment the URL is written
        install_stop_handlers(self.stop, self.name)
        async with contextlib.AsyncExitStack() as stack:
            await self._start(stack)
            host = self.cfg.serve.host
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            stack.callback(self._announce(url, key is not None))
            http = _http_server(app, self.cfg.serve)
            loops = [
                asyncio.create_task(self._follow(), name="the version follower"),
                asyncio.create_task(self._flush(), name="the publisher"),
            ]
            for loop in loops:
                loop.add_done_callback(self._loop_ended)
            log.info("%s: serving %s at %s/v1", self.name, self.model_name, url)
            serving = asyncio.create_task(http.serve(sockets=[sock]))
            await self.stop.wait()
            http.should_exit = True  # finishes the requests in flight, then returns
            await serving
            await asyncio.gather(*loops, return_exceptions=True)
            await self.batcher.close()
            await self._final_publish()

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A background loop that fails stops the server (loudly), rather than leaving it
        answering on a version it no longer follows."""
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "%s: %s failed; stopping", self.name, task.get_name(), exc_info=task.exception()
            )
            self.stop.set()

    async def _final_publish(self) -> None:
        groups = self.unpublished + self.recorder.commit(time.time())
        self.unpublished = []
        try:
            await self.publish(groups)
        except StreamRFTError as exc:
            log.error("%s: %d groups could not be published: %s", self.name, len(groups), exc)
        if self.recorder.held:
            log.info("%s: %d responses without a reward dropped", self.name, self.recorder.held)

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
            stack, self.cfg, self.name, self.events, self.view, self.follower
        )
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
