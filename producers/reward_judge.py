"""``explorer.reward: judge``: a model behind an OpenAI-compatible endpoint grades each
response by a rubric (LLM-as-judge).

For each (task, response): the rubric (``reward.rubric``, given ``{prompt}``,
``{response}``, ``{answer}``, ``{max_score}``) goes as one user message to
``reward.base_url``'s ``/chat/completions``; the last match of ``reward.score_pattern`` in
the reply is the score, and the reward is the score over ``reward.max_score``, clipped to
[0, 1] (``info``: ``judge_score``, the score as given). A call that gets no answer within
``reward.timeout_s``, a server error (5xx, 429) or a reply with no score is tried again,
``reward.retries`` times (1 s apart, then doubling); a request the judge refuses (another
4xx) is not. Then :class:`~streamrft.schemas.errors.RewardServiceError` names the endpoint
and the last reason: the workflow call fails, its tasks are retried alone
(``explorer.task_retries``), then dead-lettered with it.

At most ``reward.concurrency`` calls run at once per explorer (workflows score a group's
responses together, :func:`~streamrft.producers.rewards.score_all`); scores are kept by
(task, response) digest, the newest ``reward.cache_size``, so the same response to the
same task is graded once. A response's tries together have a deadline (``retries + 1``
times ``timeout_s``, plus the waits between them): a call still running past it (a reply
that never ends) is abandoned with RewardServiceError, and its place goes to the next.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from streamrft.infra.config import RewardConfig
from streamrft.infra.prompts import chat_messages
from streamrft.schemas.errors import ConfigError, RewardServiceError
from streamrft.schemas.experience import Task

log = logging.getLogger(__name__)

BACKOFF_S = 1.0
"""Wait before the first retry of a failed call; doubled for each next one."""
REPLY_MAX_BYTES = 1 << 20
"""Largest judge reply read; a longer one is a failed call."""

Scored = tuple[float, dict[str, float]]


class _Retry(Exception):
    """A call that may succeed if tried again (no answer, a server error, no score)."""


def task_text(task: Task) -> str:
    """The task as the rubric shows it: its prompt, or its messages as ``role: content``."""
    if task.messages:
        return "\n".join(f"{m['role']}: {m['content']}" for m in chat_messages(task))
    return task.prompt


def digest(task: Task, response: str, *more: str) -> str:
    """The cache key of ``response`` to ``task`` (its id, prompt or messages, answer) and
    whatever else decides the score (``more``)."""
    body = json.dumps([task.id, task_text(task), task.answer, response, *more])
    return hashlib.sha256(body.encode()).hexdigest()


class ScoreCache:
    """The newest ``size`` scores by key; thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, Scored] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Scored | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: str, value: Scored) -> None:
        if not self.size:
            return
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class PooledReward:
    """A reward scored by a slow service: up to ``concurrency`` at once per process, by
    (task, response) digest cached. Subclasses give :meth:`score_one`, which should end
    within ``limit_s`` of its start; one still running ``OVERRUN_S`` later is abandoned:
    :meth:`score_all` raises RewardServiceError and its place is given to the next call,
    so it never holds up later scoring."""

    OVERRUN_S = 5.0
    """How long past ``limit_s`` a call may run before it is abandoned."""

    def __init__(self, concurrency: int, cache_size: int, limit_s: float) -> None:
        self.cache = ScoreCache(cache_size)
        self.limit_s = limit_s
        """Longest one response's scoring may take, from its start."""
        self._slots = threading.BoundedSemaphore(concurrency)
        self.calls = 0
        """Responses scored by the service (cache misses)."""
        self.abandoned = 0
        """Calls given up past their limit (their threads may still be running)."""
        self._count = threading.Lock()

    def score_one(self, response: str, task: Task) -> Scored:
        raise NotImplementedError

    def key(self, response: str, task: Task) -> str:
        """The cache key of a (response, task)."""
        return digest(task, response)

    def __call__(self, response: str, task: Task) -> Scored:
        return self.score_all([(response, task)])[0]

    def score_all(self, pairs: Sequence[tuple[str, Task]]) -> list[Scored]:
        """Each pair's score, the uncached ones at once (up to ``concurrency``); raises the
        first failure, or RewardServiceError for a call past its limit."""
        keys = [self.key(response, task) for response, task in pairs]
        out: dict[str, Scored] = {}
        todo: dict[str, tuple[str, Task]] = {}
        for key, pair in zip(keys, pairs, strict=True):
            cached = self.cache.get(key)
            if cached is not None:
                out[key] = cached
            else:
                todo.setdefault(key, pair)
        calls = {key: self._start(key, *pair) for key, pair in todo.items()}
        for key, call in calls.items():
            out[key] = self._wait(call)
        return [out[key] for key in keys]

    def _start(self, key: str, response: str, task: Task) -> _Call:
        call = _Call()
        threading.Thread(
            target=self._scored,
            args=(call, key, response, task),
            name=type(self).__name__,
            daemon=True,  # one abandoned never holds up the process's exit
        ).start()
        return call

    def _scored(self, call: _Call, key: str, response: str, task: Task) -> None:
        self._slots.acquire()
        call.started = time.monotonic()
        with self._count:
            self.calls += 1
        try:
            value = self.score_one(response, task)
        except BaseException as exc:  # handed to the caller, who raises it
            call.future.set_exception(exc)
        else:
            self.cache.put(key, value)
            call.future.set_result(value)
        finally:
            self._free(call)

    def _wait(self, call: _Call) -> Scored:
        """The call's score, waiting while it is queued or within its limit."""
        while True:
            started = call.started
            allowed = self.limit_s + self.OVERRUN_S
            left = allowed if started is None else started + allowed - time.monotonic()
            if left <= 0:
                self._free(call)
                with self._count:
                    self.abandoned += 1
                log.warning(
                    "%s: a call past its limit of %g s abandoned", type(self).__name__, self.limit_s
                )
                raise RewardServiceError(
                    f"{type(self).__name__}: scoring one response took longer than "
                    f"{self.limit_s:g} s (reward.timeout_s); abandoned"
                )
            try:
                return call.future.result(timeout=left)
            except FutureTimeout:
                continue

    def _free(self, call: _Call) -> None:
        """Give the call's place back, once (by the call, or by its abandonment)."""
        with self._count:
            if call.freed:
                return
            call.freed = True
        self._slots.release()


class _Call:
    """One response being scored: its result, when it started, whether its place was
    given back."""

    def __init__(self) -> None:
        self.future: Future[Scored] = Future()
        self.started: float | None = None
        self.freed = False


class JudgeReward(PooledReward):
    """``explorer.reward: judge`` (see the module docstring)."""

    def __init__(self, cfg: RewardConfig, sleep: Callable[[float], None] = time.sleep) -> None:
        if not cfg.base_url:
            raise ConfigError("reward.base_url: the judge reward needs the judge's endpoint")
        try:
            self.pattern = re.compile(cfg.score_pattern)
        except re.error as exc:
            raise ConfigError(f"reward.score_pattern: not a regular expression: {exc}") from None
        if self.pattern.groups < 1:
            raise ConfigError("reward.score_pattern: needs a group around the score")
        _check_rubric(cfg.rubric)
        tries = cfg.retries + 1
        waits = sum(BACKOFF_S * 2**i for i in range(cfg.retries))
        super().__init__(cfg.concurrency, cfg.cache_size, tries * cfg.timeout_s + waits)
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/")
        self._sleep = sleep
        self._model = cfg.model
        self._key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        if cfg.api_key_env and not self._key:
            raise ConfigError(f"reward.api_key_env: ${cfg.api_key_env} is not set")

    def score_one(self, response: str, task: Task) -> Scored:
        cfg = self.cfg
        prompt = cfg.rubric.format(
            prompt=task_text(task), response=response, answer=task.answer, max_score=cfg.max_score
        )
        reason = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                self._sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                score = self._grade(prompt)
            except _Retry as exc:
                reason = str(exc)
                log.warning("judge at %s: %s (try %d)", self.url, reason, attempt + 1)
                continue
            return min(max(score / cfg.max_score, 0.0), 1.0), {"judge_score": score}
        raise RewardServiceError(
            f"judge at {self.url}: no score after {cfg.retries + 1} tries: {reason}"
        )

    def _grade(self, prompt: str) -> float:
        body = {
            "model": self.model(),
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }
        reply = self._request("/chat/completions", body)
        try:
            text = str(reply["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise _Retry(f"a reply that is no chat completion: {str(reply)[:200]!r}") from None
        found = self.pattern.findall(text)
        if not found:
            raise _Retry(f"no score in the reply {text[:200]!r}")
        last = found[-1]
        try:
            score = float(last[0] if isinstance(last, tuple) else last)
        except ValueError:
            raise _Retry(f"the score {last!r} is not a number") from None
        if not math.isfinite(score):
            raise _Retry(f"the score {score} is not finite")
        return score

    def model(self) -> str:
        """``reward.model``, else the endpoint's first model."""
        if not self._model:
            try:
                self._model = self._request("/models", None)["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise RewardServiceError(
                    f"judge at {self.url}: /models names no model; set reward.model"
                ) from None
        return self._model

    def _request(self, path: str, body: dict | None) -> Any:
        """The JSON reply of ``path`` (POST ``body``, or GET); :class:`_Retry` when trying
        again may help, RewardServiceError when it cannot."""
        headers = {"content-type": "application/json"}
        if self._key:
            headers["authorization"] = f"Bearer {self._key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, headers)
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as resp:
                raw = resp.read(REPLY_MAX_BYTES + 1)
        except urllib.error.HTTPError as exc:
            try:
                detail = exc.read(300).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):
                detail = exc.reason
            if exc.code >= 500 or exc.code == 429:
                raise _Retry(f"HTTP {exc.code}: {detail}") from None
            raise RewardServiceError(
                f"judge at {self.url}: {path} refused with HTTP {exc.code}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise _Retry(f"no answer ({getattr(exc, 'reason', exc)!s})") from None
        if len(raw) > REPLY_MAX_BYTES:
            raise _Retry(f"a reply over {REPLY_MAX_BYTES} bytes")
        try:
            return json.loads(raw)
        except ValueError:
            raise _Retry(f"a reply that is not JSON: {raw[:200]!r}") from None


def _check_rubric(rubric: str) -> None:
    """The rubric formats with the four fields it may use, and uses the response."""
    try:
        rubric.format(prompt="", response="", answer="", max_score=10)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"reward.rubric: {exc!r}; it may use {{prompt}}, {{response}}, {{answer}} and "
            "{max_score} (write {{ and }} for braces)"
        ) from None
    if "{response}" not in rubric:
        raise ConfigError("reward.rubric: never shows the judge the {response}")
