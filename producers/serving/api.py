"""The HTTP API of serve mode (FastAPI): OpenAI-compatible routes plus feedback and commit.

Bodies are decoded with msgspec (:mod:`.openai_types`); every refusal is an OpenAI-style
error object ``{"error": {"message", "type", "code"}}`` with its status: 400 for a bad
request, 401 without the API key, 404 for an unknown model or response id, 413 for a body
over ``serve.max_request_bytes``, 503 before the first model version (or when
``serve.max_recorded`` responses wait, or the spool of groups the broker did not take is
full or its disk refuses a file). ``/commit`` answers 200 when every group was published,
202 when some wait in the spool for the broker (``spooled_groups``).
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jinja2
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from streamrft.infra.config import ServeConfig
from streamrft.infra.prompts import PromptRenderer
from streamrft.infra.web_guard import WebGuard
from streamrft.producers.engines.base import Rollout
from streamrft.producers.serving.batcher import Sampling
from streamrft.producers.serving.completions import (
    GREEDY_TEMPERATURE,
    Choice,
    finish,
    response_body,
)
from streamrft.producers.serving.episodes import Episodes, Found, answer_given, digest
from streamrft.producers.serving.openai_types import (
    ChatRequest,
    Commit,
    CompletionRequest,
    Feedback,
    NamedChoice,
    ToolDef,
    refuse_unsupported,
    truncation,
    unknown_fields,
)
from streamrft.producers.serving.recorder import Full, Recorder, UnknownResponse
from streamrft.producers.serving.streaming import events
from streamrft.producers.serving.tool_calls import (
    Turn,
    conversation,
    offered,
    prompt_text,
)
from streamrft.producers.serving.tool_calls import parse as parse_turn
from streamrft.schemas import limits
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import ExperienceGroup, Task

CONVERSATION_HEADER = "x-conversation-id"
log = logging.getLogger(__name__)
MAX_UNKNOWN_NAMES = 64
"""Unknown request field names a server counts (the first ones; a client sending ever new
names cannot grow its memory)."""


@dataclass
class Delivery:
    """What became of the groups handed to :meth:`Backend.publish`."""

    published: list[ExperienceGroup] = field(default_factory=list)
    """Acknowledged by the broker."""
    spooled: list[ExperienceGroup] = field(default_factory=list)
    """Written to the spool (on disk): published once the broker answers again."""
    held: list[ExperienceGroup] = field(default_factory=list)
    """Neither: the spool was full, or its disk refused the file (any ``OSError``); kept
    in memory and tried again."""


class Backend(Protocol):
    """What the handlers serve from: the serve process (:class:`.server.Server`) or an
    explorer's recording endpoint (:mod:`.endpoint`)."""

    name: str
    model_name: str
    limits: ServeConfig
    temperature: float
    """Temperature of a request that names none (``explorer.temperature``)."""
    corrected: bool
    """The run's trainer corrects for a sampling distribution other than its policy's
    (``algorithm.off_policy_correction``): ``top_p`` < 1 and ``top_k`` are served."""
    context: int | None
    """The model's context length in tokens (None: unknown)."""
    prompts: PromptRenderer
    tokenizer: Any

    @property
    def recorder(self) -> Recorder:
        """Where responses wait for feedback and commit (read-only here: a subclass does)."""
        ...

    @property
    def version(self) -> int: ...

    async def sample(
        self, prompt_ids: list[int], sampling: Sampling, seed: int
    ) -> tuple[list[Rollout], int]: ...

    async def publish(self, groups: list) -> Delivery: ...

    def refusal(self) -> str | None:
        """Why completions and commits get 503 now (the spool is full or cannot be
        written), None when not."""
        ...


class ApiError(Exception):
    """A refusal with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def _error_body(exc: ApiError) -> dict:
    """The OpenAI API's error object."""
    return {"error": {"message": str(exc), "type": exc.kind, "code": exc.status}}


def _error(exc: ApiError) -> Response:
    return _json(_error_body(exc), exc.status)


DRAIN_FACTOR = 8
"""A body over the limit is read and discarded up to this many times the limit before the
413 goes out, so an ordinary client gets the 413 rather than a broken pipe; beyond that
the connection is dropped."""


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (by its length header or as it
    streams in), the body drained first (:data:`DRAIN_FACTOR`)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._drain(receive, 0)
            return await _error(self._too_big())(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                if message.get("more_body"):
                    await self._drain(receive, seen)
                raise self._too_big()
            return message

        return await self.app(scope, counted, send)

    async def _drain(self, receive: Callable, seen: int) -> None:
        while seen <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            seen += len(message.get("body", b""))
            if not message.get("more_body"):
                return

    def _too_big(self) -> ApiError:
        return ApiError(413, f"request body over {self.max_bytes} bytes (serve.max_request_bytes)")


def _decode(body: bytes, type_: type) -> Any:
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"bad request body: {exc}") from exc


def build_app(
    server: Backend,
    key: str | None,
    prefix: str = "",
    feedback: bool = True,
    bound: str = "127.0.0.1",
    hosts: Sequence[str] = (),
    origins: Sequence[str] = (),
) -> Any:
    """The FastAPI app of ``server``; ``key``: the API key every route but /health needs.
    ``prefix`` goes before every route (``/ep/{conversation}``: the conversation id is
    part of the URL); ``feedback``: with ``/feedback`` and ``/commit``. ``bound``,
    ``hosts``, ``origins``: the address it listens on and the allowed ``Host`` names and
    web origins (:class:`~streamrft.infra.web_guard.WebGuard`: checked first, before the
    body is read)."""
    app = FastAPI(title="streamrft serve", docs_url=None, redoc_url=None, openapi_url=None)
    handlers = Handlers(server)

    def route(path: str, handler: Callable[[Request], Awaitable[Any]], method: str) -> None:
        async def endpoint(request: Request) -> Response:
            try:
                if key is not None and not _authorised(request, key):
                    if path != "/health":
                        raise ApiError(
                            401,
                            "missing or wrong API key (Authorization: Bearer ...)",
                            "auth_error",
                        )
                    # a probe without the key learns whether it serves, nothing else
                    return _json({"status": (await handler(request))["status"]})
                answer = await handler(request)
                return answer if isinstance(answer, Response) else _json(answer)
            except ApiError as exc:
                return _error(exc)
            except SchemaError as exc:
                return _error(ApiError(400, str(exc)))
            except Exception as exc:  # a bug or an engine failure: an answer, not a dropped socket
                log.exception("%s %s failed", method, path)
                return _error(ApiError(500, f"{type(exc).__name__}: {exc}", "server_error"))

        app.add_api_route(prefix + path, endpoint, methods=[method])

    route("/health", handlers.health, "GET")
    route("/v1/models", handlers.models, "GET")
    route("/v1/chat/completions", handlers.chat, "POST")
    route("/v1/completions", handlers.completion, "POST")
    if feedback:
        route("/feedback", handlers.feedback, "POST")
        route("/commit", handlers.commit, "POST")
    limited = BodyLimit(app, server.limits.max_request_bytes)
    return WebGuard(
        limited, bound, hosts, origins, error=lambda status, msg: _error_body(ApiError(status, msg))
    )


@dataclass(frozen=True)
class Episode:
    """What a chat request brings to its recording (:mod:`.episodes`)."""

    prompt: bytes
    """The digest of its rendered prompt."""
    found: Found
    """The recorded response it continues (``serve.record: episode``), if any."""
    tools: list[ToolDef]
    """The tools it offers: its choices are read for calls."""


def _conversation(request: Request, req: ChatRequest | CompletionRequest) -> str | None:
    """The conversation a request names: by its URL (an agent episode's), its
    ``conversation_id`` or the header."""
    return (
        request.path_params.get("conversation")
        or req.conversation_id
        or request.headers.get(CONVERSATION_HEADER)
    )


def _authorised(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    return secrets.compare_digest(given.encode(), f"Bearer {key}".encode())


class Handlers:
    """One method per route."""

    def __init__(self, server: Backend) -> None:
        self.server = server
        self.unknown_fields: Counter[str] = Counter()
        """Requests that carried each field no rule names (:mod:`.openai_types`)."""
        self.episodes = Episodes(server.prompts)
        """Finds the recorded response a chat request continues; counts the outcomes."""
        self.tool_stats: Counter[str] = Counter()
        """Tool calls answered, turns of malformed calls returned as text, and answers
        without the call ``tool_choice`` asked for (:mod:`.tool_calls`)."""

    def _decode(self, body: bytes, type_: type) -> Any:
        """The request, its unknown fields logged (once each) and counted."""
        req = _decode(body, type_)
        for name in unknown_fields(body, type_):
            if name not in self.unknown_fields:
                if len(self.unknown_fields) >= MAX_UNKNOWN_NAMES:
                    continue
                log.info(
                    "%s: request field %r is not one it reads; ignored", self.server.name, name
                )
            self.unknown_fields[name] += 1
        return req

    def _refuse_when_full(self) -> None:
        reason = self.server.refusal()
        if reason is not None:
            raise ApiError(503, reason, "server_error")

    @property
    def cfg(self) -> ServeConfig:
        """The server's limits as they are now (the agent endpoint's change every step)."""
        return self.server.limits

    async def health(self, _request: Request) -> dict[str, Any]:
        version = self.server.version
        return {
            "status": "ok" if version >= 0 else "waiting for the first model version",
            "server": self.server.name,
            "model": self.server.model_name,
            "model_version": version,
            "recorded": self.server.recorder.held,
            "unknown_fields": dict(self.unknown_fields),
            "tool_calls": {k: self.tool_stats[k] for k in ("calls", "malformed", "unmet")},
            "episodes": {
                k: self.episodes.stats[k] for k in ("continued", "unmatched", "rewritten")
            },
        }

    async def models(self, _request: Request) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.server.model_name, "object": "model", "owned_by": "streamrft"}],
        }

    async def chat(self, request: Request) -> dict[str, Any] | Response:
        req = self._decode(await request.body(), ChatRequest)
        tools = offered(req.tools, req.tool_choice)
        prompts = self.server.prompts
        messages = conversation(req.messages)
        render = functools.partial(prompt_text, prompts, tools=tools, choice=req.tool_choice)
        try:
            text = render(messages)
        except jinja2.TemplateError as exc:  # its raise_exception: roles, alternation...
            raise ApiError(400, f"the model's chat template refused the messages: {exc}") from exc
        found = Found(None, None)
        if self.cfg.record == "episode":
            found = self.episodes.find(
                self.server.recorder,
                messages,
                lambda m, gen: render(m, generation_prompt=gen),
                text,
                req.previous_response_id,
                _conversation(request, req),
            )
        cont = found.continuation
        prompt_ids = cont.prompt_ids if cont else prompts.tokenize(text)
        max_tokens = req.max_completion_tokens or req.max_tokens
        episode = Episode(digest(text), found, tools)
        return await self._complete(
            request, req, prompt_ids, max_tokens, True, req.logprobs, episode
        )

    def _read_calls(
        self, choices: list[Choice], req: ChatRequest | CompletionRequest, tools: list
    ) -> list[Turn]:
        """Each choice read for tool calls (``serve.tool_parser``), counted."""
        turns = [parse_turn(self.cfg.tool_parser, c.rollout.text, tools) for c in choices]
        choice = req.tool_choice if isinstance(req, ChatRequest) else None
        must = choice == "required" or isinstance(choice, NamedChoice)
        for turn in turns:
            self.tool_stats["calls"] += len(turn.calls)
            self.tool_stats["malformed"] += turn.malformed
            self.tool_stats["unmet"] += must and not turn.calls
        return turns

    async def completion(self, request: Request) -> dict[str, Any] | Response:
        req = self._decode(await request.body(), CompletionRequest)
        prompt_ids = self.server.prompts.ids(Task(id="serve", prompt=req.text()))
        logprobs = req.logprobs is not None
        return await self._complete(request, req, prompt_ids, req.max_tokens, False, logprobs)

    async def _complete(
        self,
        request: Request,
        req: ChatRequest | CompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        chat: bool,
        with_logprobs: bool,
        episode: Episode | None = None,
    ) -> dict[str, Any] | Response:
        """Check, sample, record and answer one completion request (``episode``: a chat
        request's history, what it continues and the tools it offers, for which its
        choices are read); ``stream``: as SSE chunks."""
        max_tokens = self._check(req, prompt_ids, max_tokens)
        server = self.server
        self._refuse_when_full()
        try:  # before the engine runs: a full server refuses without sampling
            server.recorder.check_room(req.n, req.n * (len(prompt_ids) + max_tokens))
        except Full as exc:
            raise ApiError(503, str(exc), "server_error") from exc
        temperature = server.temperature if req.temperature is None else req.temperature
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        temperature = max(temperature, GREEDY_TEMPERATURE)  # recorded as sampled
        top_p, top_k = truncation(req)
        sampling = Sampling(req.n, temperature, max_tokens, top_p, top_k)
        rollouts, version = await server.sample(prompt_ids, sampling, seed)
        choices = [finish(r, server.tokenizer, req.stops(), max_tokens) for r in rollouts]
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        tools = episode.tools if episode else None
        turns = self._read_calls(choices, req, tools) if tools else None  # never raises
        answers = [
            answer_given(c.rollout.text, turns[i] if turns else None) for i, c in enumerate(choices)
        ]
        try:
            server.recorder.record(
                response_id,
                [c.rollout for c in choices],
                version,
                temperature,
                _conversation(request, req),
                time.time(),
                answers=answers if chat else None,
                digest=episode.prompt if episode else b"",
                parent=episode.found.continuation if episode else None,
            )
        except Full as exc:
            raise ApiError(503, str(exc), "server_error") from exc
        if episode:
            self.episodes.count(episode.found)
        body = response_body(
            chat,
            response_id,
            server.model_name,
            int(time.time()),
            version,
            prompt_ids,
            choices,
            server.tokenizer,
            with_logprobs,
            turns,
        )
        if not req.stream:
            return body
        # recorded already: a client that goes away leaves it to its reward or its TTL
        usage = req.stream_options is not None and req.stream_options.include_usage
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        frames = list(events(body, usage))  # a failure here is a 500, not a broken 200
        return StreamingResponse(iter(frames), media_type="text/event-stream", headers=headers)

    def _check(
        self, req: ChatRequest | CompletionRequest, prompt_ids: list[int], max_tokens: int | None
    ) -> int:
        """Refuse what cannot be served; the request's ``max_tokens``, or for one that names
        none the default (``serve.max_tokens``) cut to what the model's context leaves."""
        refuse_unsupported(req, self.server.corrected)
        req.stops()
        if req.model and req.model != self.server.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} not found; this server serves {self.server.model_name!r}",
                "not_found_error",
            )
        if self.server.version < 0:
            raise ApiError(
                503,
                "no model version yet (the trainer publishes version 0 when it starts)",
                "server_error",
            )
        if req.n > self.cfg.max_n:
            raise ApiError(400, f"n: {req.n} is over serve.max_n={self.cfg.max_n}")
        context = self.server.context
        if max_tokens is None:  # as many as the context leaves, up to the default
            room = None if context is None else context - len(prompt_ids)
            max_tokens = (
                self.cfg.max_tokens if room is None else max(1, min(room, self.cfg.max_tokens))
            )
        if max_tokens > self.cfg.max_tokens:
            raise ApiError(
                400, f"max_tokens: {max_tokens} is over serve.max_tokens={self.cfg.max_tokens}"
            )
        if context is not None and len(prompt_ids) + max_tokens > context:
            raise ApiError(
                400,
                f"the prompt's {len(prompt_ids)} tokens + max_tokens "
                f"{max_tokens} exceed the model's context of {context} tokens",
            )
        return max_tokens

    async def feedback(self, request: Request) -> dict[str, Any]:
        fb = _decode(await request.body(), Feedback)
        if not math.isfinite(fb.reward) or abs(fb.reward) > limits.MAX_ABS_REWARD:
            raise ApiError(
                400, f"reward: {fb.reward} is not finite within +-{limits.MAX_ABS_REWARD:g}"
            )
        try:
            n = self.server.recorder.feedback(
                fb.reward, fb.response_id, fb.conversation_id, fb.choice
            )
        except UnknownResponse as exc:
            raise ApiError(404, str(exc), "not_found_error") from exc
        return {"rewarded": n}

    async def commit(self, request: Request) -> dict[str, Any] | Response:
        """200: every group published; 202: some wait in the spool (on disk) and are
        published once the broker answers again; 503 when the spool is full or its disk
        refuses the file (the responses stay held before the commit; after it, the groups
        wait in the server's memory, tried again every second: none is lost)."""
        body = await request.body()
        req = _decode(body, Commit) if body.strip() else Commit()
        self._refuse_when_full()  # the responses stay held: commit again later
        try:
            groups = self.server.recorder.commit(time.time(), req.response_id, req.conversation_id)
        except UnknownResponse as exc:
            raise ApiError(404, str(exc), "not_found_error") from exc
        delivery = await self.server.publish(groups)
        if delivery.held:
            reason = f"{self.server.refusal()} (this commit's {len(delivery.held)} among them)"
            raise ApiError(503, reason, "server_error")
        answer = {
            "published_groups": len(delivery.published),
            "published_experiences": sum(len(g.experiences) for g in delivery.published),
            "spooled_groups": len(delivery.spooled),
            "group_ids": [g.id for g in groups],
        }
        return _json(answer, 202) if delivery.spooled else answer
