"""The policy a sampling process holds and keeps on the run's versions: an explorer's, or
serve mode's."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from streamrft.infra import kafka
from streamrft.infra.bus import HEARTBEAT_S, ControlView, Counters, EventSender
from streamrft.infra.config import Config
from streamrft.infra.modeling import load_policy
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines import make_engine
from streamrft.producers.engines.base import RolloutEngine, SerialEngine
from streamrft.schemas.errors import StreamRFTError
from streamrft.schemas.events import RunState
from streamrft.sync.follower import WeightFollower
from streamrft.sync.payload import ModelWeights


@dataclass
class FollowedPolicy:
    """The engine around the configured model (LoRA attached when configured; calls from
    several threads take turns, version loads between them: :class:`SerialEngine`), the
    prompt renderer of ``taskset.*``, and the weight follower that applies versions to it."""

    engine: RolloutEngine
    tokenizer: Any
    prompts: PromptRenderer
    follower: WeightFollower


def followed_policy(
    cfg: Config,
    name: str,
    view: ControlView,
    events: EventSender,
    counters: Counters,
    stop: asyncio.Event,
) -> FollowedPolicy:
    """Load the policy of ``cfg`` for component ``name`` (see :class:`FollowedPolicy`)."""
    model, tokenizer = load_policy(cfg.model)
    if cfg.model.lora.enabled:
        from streamrft.sync.lora import attach_lora

        model = attach_lora(model, cfg.model.lora)
    engine = SerialEngine(make_engine(cfg.explorer.engine, model, tokenizer, cfg.explorer))
    weights = ModelWeights(model, cfg.model.lora.enabled, target=engine)
    follower = WeightFollower(cfg, name, weights, view, events, counters, stop)
    return FollowedPolicy(
        engine, tokenizer, PromptRenderer.from_config(cfg.taskset, tokenizer), follower
    )


async def start_sampler(
    stack: contextlib.AsyncExitStack,
    cfg: Config,
    name: str,
    events: EventSender,
    view: ControlView,
    follower: WeightFollower,
    request_timeout_s: float | None = None,
    data: bool = True,
) -> Any:
    """Start what a sampling process (explorer, serve, evaluator) talks through, each
    stopped in reverse order by ``stack``: its event sender (heartbeats; a STOPPED status at
    the end), the control view, the follower's receivers; returns its started data producer
    (its records fail after ``request_timeout_s``; None: the Kafka module's default), or
    None without ``data`` (an evaluator publishes events only)."""
    await events.start(heartbeat_s=HEARTBEAT_S)
    stack.push_async_callback(events.stop)
    stack.push_async_callback(_report_stopped, events)
    stack.callback(follower.close)
    await view.start()
    stack.push_async_callback(view.stop)
    if not data:
        return None
    timeout_ms = kafka.REQUEST_TIMEOUT_MS
    if request_timeout_s is not None:
        timeout_ms = round(request_timeout_s * 1000)
    producer = kafka.data_producer(cfg.kafka, f"{name}-data", timeout_ms)
    await kafka.start_client(producer, f"{name} producer")  # closes it on failure
    stack.push_async_callback(producer.stop)
    return producer


async def _report_stopped(events: EventSender) -> None:
    with contextlib.suppress(StreamRFTError):
        await events.status(RunState.STOPPED, "stopped")
