"""Partial rollouts (``explorer.partial_rollout``): an episode takes a newer version between
two turns, never inside an engine call; each turn's tokens carry the version that sampled
them, and the episode counts by its oldest."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from streamrft.consumers.batching import collate, response_logprobs
from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.producers.engines import TransformersEngine
from streamrft.producers.engines.base import Rollout, SerialEngine
from streamrft.producers.rewards import exact_match
from streamrft.producers.workflows import WORKFLOWS, RolloutSpec
from streamrft.schemas import Segment, Task
from streamrft.schemas.experience import validate_group
from streamrft.sync.weights import unique_state_dict
from tests.helpers.groups import make_group
from tests.helpers.scripted import CHARSET

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)

TURNS = '["go on", "more"]'
"""The conversation environment's user turns: three policy turns per episode."""


def _model(tok, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, max_positions=160
    )
    return build_tiny_model(cfg, tok).eval()


def _spec(refresh) -> RolloutSpec:
    return RolloutSpec(
        repeat_times=3,
        temperature=1.0,
        max_new_tokens=6,
        seed=0,
        run="r",
        explorer="explorer-0",
        model_version=3,
        refresh=refresh,
    )


def _tasks() -> list[Task]:
    return [
        Task(id=f"t{i}", prompt=p, answer="7", workflow="multi_turn", metadata={"turns": TURNS})
        for i, p in enumerate(["3+4=", "12+30="])
    ]


def test_a_version_taken_between_turns_stamps_the_tokens_it_sampled():
    """Version 3 samples the first turn; the refresh before the second applies version 5
    (other weights); every token of the later turns is version 5's: its segment starts at
    the second policy turn, its log-probs are version 5's on the whole sequence, the first
    turn's version 3's; the episode and its group count as version 3."""
    tok = build_char_tokenizer(CHARSET)
    old, new = _model(tok, 0), _model(tok, 1)
    engine = SerialEngine(TransformersEngine(_model(tok, 2), tok))
    engine.load_weights(3, unique_state_dict(old))
    refreshes = []

    def refresh() -> None:
        refreshes.append(engine.version)
        if engine.version == 3:
            engine.load_weights(5, unique_state_dict(new))

    groups = WORKFLOWS["multi_turn"](engine, _tasks(), exact_match, _spec(refresh))
    assert refreshes == [3, 5]  # before the second and the third turn, never the first
    experiences = [e for g in groups for e in validate_group(g).experiences]
    assert {g.model_version for g in groups} == {3}
    for exp in experiences:
        mask = list(exp.action_mask)
        second_turn = mask.index(1, mask.index(0))  # the first policy token after the glue
        assert exp.model_version == 3
        assert exp.segments == [Segment(start=0, version=3), Segment(start=second_turn, version=5)]
    batch = collate(experiences, tok.pad_token_id)
    on = batch.response_mask.bool()
    for model, version in ((old, 3), (new, 5)):
        with torch.no_grad():
            logp = response_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.prompt_width
            )
        mine = on & (batch.versions == version)
        assert mine.sum() > 0
        torch.testing.assert_close(logp[mine], batch.old_logprobs[mine], atol=1e-4, rtol=0)


def test_without_a_newer_version_an_episode_is_one_segment():
    tok = build_char_tokenizer(CHARSET)
    engine = SerialEngine(TransformersEngine(_model(tok, 0), tok))
    engine.load_weights(3, unique_state_dict(engine.model))
    groups = WORKFLOWS["multi_turn"](engine, _tasks(), exact_match, _spec(lambda: None))
    for g in groups:
        assert g.model_version == 3
        assert all(e.segments == [] and e.model_version == 3 for e in g.experiences)


class _SlowEngine:
    """Records the version its wrapper holds when a call begins and ends."""

    def __init__(self, outer: list[SerialEngine]) -> None:
        self.outer, self.seen = outer, []

    def rollout(self, prompts, n, temperature, max_new_tokens, seed, top_p=1.0, top_k=0):
        start = self.outer[0].version
        time.sleep(0.3)
        self.seen.append((start, self.outer[0].version))
        return [[Rollout(p, [1], [-0.5], "x") for _ in range(n)] for p in prompts]

    def load_weights(self, version, tensors) -> None:
        pass


def test_no_version_is_applied_inside_an_engine_call():
    """A version loaded while a call samples waits for the call to end; the call's
    rollouts carry the version it began with."""
    outer: list[SerialEngine] = []
    inner = _SlowEngine(outer)
    engine = SerialEngine(inner)  # type: ignore[arg-type]
    outer.append(engine)
    engine.load_weights(3, {})
    got = []
    sampling = threading.Thread(target=lambda: got.extend(engine.rollout([[1, 2]], 2, 1.0, 1, 0)))
    sampling.start()
    time.sleep(0.1)  # the call is under way
    engine.load_weights(4, {})  # blocks until the call is done
    sampling.join()
    assert inner.seen == [(3, 3)]
    assert [r.version for r in got[0]] == [3, 3]
    assert engine.version == 4
    (after,) = engine.rollout([[1, 2]], 1, 1.0, 1, 0)
    assert after[0].version == 4


def test_staleness_counts_a_partial_rollout_by_its_oldest_segment():
    """A group sampled by version 1, then 3 from its second response token, is dropped by
    a trainer at version 4 with max_staleness 2 (4 - 1 > 2), however fresh its last
    segment; the same tokens all sampled by version 3 are kept."""
    partial = make_group("r", "t", 1, n=2)
    partial = msgspec.structs.replace(
        partial,
        experiences=[
            msgspec.structs.replace(
                e, segments=[Segment(start=0, version=1), Segment(start=1, version=3)]
            )
            for e in partial.experiences
        ],
    )
    fresh = make_group("r", "u", 3, n=2)
    buffer = ExperienceBuffer(max_staleness=2)
    for offset, g in enumerate((validate_group(partial), validate_group(fresh))):
        assert buffer.offer(g, ("experiences", 0), offset)
    dropped = buffer.drop_stale(4)
    assert [g.id for g in dropped] == [partial.id]
