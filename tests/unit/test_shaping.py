"""Truncated responses and overlong ones (``algorithm.mask_truncated``,
``overlong_buffer``, ``overlong_penalty``): the explorer marks a response cut at
``max_new_tokens``, the trainer leaves it out of the loss when asked, and DAPO's soft
overlong punishment equals its formula and reaches the advantages."""

from __future__ import annotations

import pytest
import torch

from streamrft.consumers.algorithms.shaping import overlong_penalty, shape_batch, truncated_rows
from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.consumers.batching import collate
from streamrft.consumers.train_engine import TorchTrainEngine
from streamrft.infra.config import from_dict
from streamrft.infra.modeling import build_char_tokenizer
from streamrft.producers.engines import SimulatedEngine
from streamrft.producers.engines.base import Rollout, ends_without_eos
from streamrft.schemas.errors import ConfigError
from tests.helpers.groups import make_group
from tests.helpers.learning import learning_config

pytestmark = pytest.mark.unit

TRUNC = {"truncated": 1.0}
DONE = {"truncated": 0.0}


def test_the_overlong_penalty_equals_dapos_formula_by_hand():
    # L = 10, buffer 4: nothing up to 6 tokens, then -0.5 x (n - 6) / 4, -0.5 from 10 on
    spec = AlgorithmSpec(max_new_tokens=10, overlong_buffer=4, overlong_penalty=0.5)
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10, 12]), spec)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def test_a_response_without_its_eos_is_truncated():
    eos = 2
    assert ends_without_eos([5, 6, 7], eos) and not ends_without_eos([5, 6, eos], eos)
    rollout = Rollout([1, 4], [5, 6], [-0.1, -0.2], "ab", truncated=True)
    assert rollout.experience("e", 1.0, 0, {}).info == {"response_length": 2.0, "truncated": 1.0}
    # the simulated engine never samples an EOS: all its responses run to max_new_tokens
    engine = SimulatedEngine(torch.nn.Linear(1, 1), build_char_tokenizer())
    [[a, b]] = engine.rollout([[1, 4]], 2, 1.0, 3, seed=0)
    assert a.truncated and b.truncated and len(a.response_ids) == 3


def _batch(groups):
    return collate([e for g in groups for e in g.experiences], pad_id=0)


def test_shape_batch_masks_truncated_rows_and_leaves_their_rewards():
    group = make_group("r", "t", 0, 3, rewards=[1.0, 0.0, 1.0], infos=[DONE, TRUNC, {}])
    batch = _batch([group])
    rows = truncated_rows([group])
    assert rows == [False, True, False]
    same, metrics = shape_batch(batch, rows, AlgorithmSpec())
    assert torch.equal(same.response_mask, batch.response_mask)
    assert metrics == {"train/truncated_share": pytest.approx(1 / 3)}
    masked, metrics = shape_batch(batch, rows, AlgorithmSpec(mask_truncated=True))
    assert masked.response_mask.sum(1).tolist() == [2.0, 0.0, 2.0]
    assert torch.equal(masked.rewards, batch.rewards)
    assert metrics["train/truncated_masked"] == 1.0


def _engine(**algorithm) -> TorchTrainEngine:
    engine = TorchTrainEngine(learning_config({"type": "grpo", **algorithm}))
    engine.prepare()
    return engine


def _weights(engine: TorchTrainEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.model.parameters()]


def test_a_truncated_row_gets_no_gradient():
    """The step with ``mask_truncated`` on a batch with truncated rows ends with the same
    weights as the step on that batch with those rows' tokens masked by hand; and a batch
    of truncated rows only leaves the weights as they were."""
    toks = [[1, 5, 6, 7, 8, 9], [1, 5, 6, 7, 10, 11], [1, 5, 6, 7, 12, 13], [1, 5, 6, 7, 14, 2]]
    infos = [TRUNC, DONE, TRUNC, DONE]
    flagged = make_group("r", "t", 0, 4, rewards=[1.0, 0.0, 0.0, 1.0], tokens=toks, infos=infos)
    by_hand = make_group(
        "r", "t", 0, 4, rewards=[1.0, 0.0, 0.0, 1.0], tokens=toks,
        masks=[[0, 0], [1, 1], [0, 0], [1, 1]], infos=[DONE] * 4,
    )  # fmt: skip
    masked, plain = _engine(mask_truncated=True), _engine()
    masked.train_step([flagged], version=0)
    plain.train_step([by_hand], version=0)
    for a, b in zip(_weights(masked), _weights(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    only = make_group("r", "u", 0, 2, rewards=[1.0, 0.0], infos=[TRUNC, TRUNC])
    still = _engine(mask_truncated=True)
    before = _weights(still)
    metrics = still.train_step([only], version=0)
    assert metrics["train/truncated_masked"] == 2.0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(still), strict=True))
    moved = _engine()
    before = _weights(moved)
    moved.train_step([only], version=0)
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(moved), strict=True))


def test_the_overlong_penalty_reaches_the_advantages():
    """Four correct answers of 1, 2, 3 and 4 tokens (max_new_tokens 4 in the learning
    config, buffer 2): GRPO sees no difference without the penalty, and with it the two
    longest are pushed down by 0.5 and 1.0."""
    toks = [[1, 5, 6, 7, *resp] for resp in ([2], [8, 2], [8, 9, 2], [8, 9, 10, 11])]
    masks = [[1] * (len(t) - 4) for t in toks]
    logprobs = [[-0.5] * len(m) for m in masks]
    group = make_group(
        "r", "t", 0, 4, rewards=[1.0] * 4, tokens=toks, masks=masks, logprobs=logprobs
    )
    flat = _engine().train_step([group], version=0)
    assert flat["train/advantage_abs_mean"] == 0.0 and "train/overlong_penalty_mean" not in flat
    shaped = _engine(overlong_buffer=2).train_step([group], version=0)
    assert shaped["train/overlong_penalty_mean"] == pytest.approx(-(0.5 + 1.0) / 4)
    assert shaped["train/advantage_abs_mean"] > 0.5


def test_a_buffer_longer_than_the_responses_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm\.overlong_buffer: 9 is longer"):
        from_dict(
            {
                "taskset": {"path": "t.jsonl"},
                "explorer": {"max_new_tokens": 8},
                "algorithm": {"overlong_buffer": 9},
            }
        )
