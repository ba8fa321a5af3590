"""The policy a sampling process holds and keeps on the run's versions: an explorer's, or
serve mode's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from streamrft.infra.bus import ControlView, Counters, EventSender
from streamrft.infra.config import Config
from streamrft.infra.modeling import load_policy
from streamrft.infra.prompts import PromptRenderer
from streamrft.producers.engines import make_engine
from streamrft.producers.engines.base import RolloutEngine, SerialEngine
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
