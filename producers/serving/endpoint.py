"""An explorer's own recording endpoint: the serve API in process, for agent workflows.

The ``agent`` workflow (:mod:`streamrft.producers.workflows.agent`) gives each episode a
base URL ``http://127.0.0.1:<port>/ep/<episode>/v1`` of this endpoint; the user's agent
code talks to it with any OpenAI client, and every completion it asks for is sampled by the
explorer's engine and recorded under that episode with the version that sampled it.
When the agent returns, the workflow takes the episode's responses with its reward
(:meth:`RecordingEndpoint.collect`). The endpoint runs uvicorn on its own thread and event
loop, started on first use and kept for the life of the process; engine calls are
serialised (one at a time) and a version is applied only between two of them: at step
boundaries, and with ``explorer.partial_rollout`` also when another workflow call of the
step takes a newer version between its turns; an episode counts by its oldest turn.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from streamrft.infra.config import ServeConfig
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines.base import Rollout, RolloutEngine
from streamrft.producers.serving.batcher import Batcher, Sampling, engine_call
from streamrft.producers.serving.recorder import Recorded, Recorder, Ref
from streamrft.schemas.errors import ServiceError, StreamRFTError
from streamrft.schemas.experience import Experience, ExperienceGroup

MODEL_NAME = "policy"
"""The model name the endpoint serves (requests may also name none)."""
START_TIMEOUT_S = 30.0
CLOSED_KEPT = 100_000
"""Closed episodes remembered (a late completion for an older one would be recorded and
never collected; episode ids are random, so none is reused)."""


class LockedRecorder(Recorder):
    """A :class:`Recorder` used from the server's thread and the workflow's threads. An
    episode once taken is closed: a completion that still comes for it (the agent's client
    gave up on it, or retried) is answered but not recorded (``late``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._lock = threading.RLock()  # record looks its parent up
        self.closed: OrderedDict[str, None] = OrderedDict()
        self.late = 0

    def record(
        self,
        response_id: str,
        rollouts: list[Rollout],
        version: int,
        temperature: float,
        conversation: str | None,
        now: float,
        **episode: Any,
    ) -> None:
        with self._lock:
            if conversation in self.closed:
                self.late += len(rollouts)
                return
            super().record(
                response_id, rollouts, version, temperature, conversation, now, **episode
            )

    # what the server's thread looks up while a workflow's thread may take or expire
    def get(self, ref: Ref) -> Recorded | None:
        with self._lock:
            return super().get(ref)

    def group_key(self, response_id: str) -> str | None:
        with self._lock:
            return super().group_key(response_id)

    def choices_of(self, response_id: str) -> list[tuple[Ref, Recorded]]:
        with self._lock:
            return super().choices_of(response_id)

    def responses_of(self, conversation: str) -> list[tuple[Ref, Recorded]]:
        with self._lock:
            return super().responses_of(conversation)

    def take(self, conversation: str, reward: float) -> list[ExperienceGroup]:
        """The responses of ``conversation`` rewarded with ``reward``, as groups (none if
        the agent asked for no completion); the episode is closed."""
        with self._lock:
            self.closed[conversation] = None
            while len(self.closed) > CLOSED_KEPT:
                self.closed.popitem(last=False)
            if conversation not in self.groups:
                return []
            self.feedback(reward, conversation=conversation)
            return self.commit(time.time(), conversation=conversation)

    def expire(self, now: float, ttl_s: float) -> int:
        """Drop what episodes recorded and never took for ``ttl_s`` (an agent stuck past
        its task's timeout, abandoned on its thread); how many responses went."""
        with self._lock:
            before = self.expired
            self.ready(now, 0.0, ttl_s)  # no group is due (no size, no timeout): only expiry
            return self.expired - before


class RecordingEndpoint:
    """The serve API (:func:`~.api.build_app`, without feedback and commit) around an
    explorer's engine; see the module docstring."""

    def __init__(self, engine: RolloutEngine, prompts: PromptRenderer, run: str, name: str):
        self.engine = engine
        self.name = name
        self.model_name = MODEL_NAME
        self.limits = ServeConfig()
        self.temperature = 1.0
        self.corrected = False
        self.context = getattr(
            getattr(engine.model, "config", None), "max_position_embeddings", None
        )
        self.prompts = prompts
        self.tokenizer = engine.tokenizer
        self.recorder = LockedRecorder(run, name, 0, self.limits.max_recorded)
        self._version = -1
        self._engine_lock = threading.Lock()
        self._batcher: Batcher | None = None
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def version(self) -> int:
        return self._version

    def prepare(
        self,
        version: int,
        temperature: float,
        max_tokens: int,
        record: str = "episode",
        corrected: bool = False,
        max_batch: int = 32,
    ) -> None:
        """Set the step's version, the defaults of a request that names none, how
        episodes are recorded (``explorer.agent_record``), whether truncated sampling is
        served (``corrected``: the run's ``algorithm.off_policy_correction`` is set) and
        the most requests one engine call samples (the episodes that run at once)."""
        self._version = version
        self.corrected = corrected
        self.temperature = temperature
        self.limits = ServeConfig(max_tokens=max_tokens, record=record, max_batch=max_batch)  # type: ignore[arg-type]
        if self._batcher is not None:
            self._batcher.max_batch = max_batch

    async def sample(
        self, prompt_ids: list[int], sampling: Sampling, seed: int
    ) -> tuple[list[Rollout], int]:
        """Batched with the concurrent episodes' requests (:mod:`.batcher`)."""
        if self._batcher is None:  # made on the server's own event loop
            self._batcher = Batcher(self._call, self.limits.max_batch)
        return await self._batcher.sample(prompt_ids, sampling, seed)

    async def _call(
        self, prompts: list[list[int]], sampling: Sampling, seed: int
    ) -> tuple[list[list[Rollout]], int]:
        grouped = await asyncio.to_thread(self._rollout, prompts, sampling, seed)
        return grouped, grouped[0][0].sampled_by(self._version)  # one call: one version

    def _rollout(self, prompts: list[list[int]], sampling: Sampling, seed: int):
        with self._engine_lock:
            return engine_call(self.engine, prompts, sampling, seed)

    async def publish(self, groups: list) -> Any:
        raise StreamRFTError("the agent workflow collects its episodes itself")

    def refusal(self) -> str | None:
        return None  # nothing is spooled here: the explorer publishes the episodes

    def base_url(self, episode: str) -> str:
        """The OpenAI base URL of one episode (``episode``: URL-safe)."""
        return f"http://127.0.0.1:{self.port}/ep/{episode}/v1"

    def collect(self, episode: str, reward: float) -> list[Experience]:
        """The experiences of ``episode`` (each response it asked for), rewarded; the
        responses of episodes abandoned for ``serve.unrewarded_ttl_s`` are dropped."""
        taken = [e for g in self.recorder.take(episode, reward) for e in g.experiences]
        self.recorder.expire(time.time(), self.limits.unrewarded_ttl_s)
        return taken

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Serve on 127.0.0.1 (a free port) from a daemon thread; returns once it listens."""
        import uvicorn

        from streamrft.producers.serving.api import build_app

        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see server.py
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        app = build_app(self, None, prefix="/ep/{conversation}", feedback=False)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)  # off the main thread: installs no signal handlers
        thread = threading.Thread(
            target=asyncio.run,
            args=(self._server.serve(sockets=[sock]),),
            name=f"{self.name}-agent-endpoint",
            daemon=True,
        )
        thread.start()
        self._thread = thread
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ServiceError(f"{self.name}: the agent endpoint did not start")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and wait for the server's thread (a process that ends needs not:
        the thread is a daemon)."""
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)


_ENDPOINTS: dict[int, RecordingEndpoint] = {}
_START_LOCK = threading.Lock()


def recording_endpoint(
    engine: RolloutEngine, prompts: PromptRenderer, run: str, name: str
) -> RecordingEndpoint:
    """The endpoint of ``engine`` (one per engine, started on first use)."""
    with _START_LOCK:
        endpoint = _ENDPOINTS.get(id(engine))
        if endpoint is None or endpoint.engine is not engine:
            endpoint = RecordingEndpoint(engine, prompts, run, name)
            endpoint.start()
            _ENDPOINTS[id(engine)] = endpoint
        return endpoint
