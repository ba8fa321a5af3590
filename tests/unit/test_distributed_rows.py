"""The pure parts of the multi-rank trainer: which rows each rank trains and with what
weight, the command encoding, the optimizer state's two layouts."""

from __future__ import annotations

import msgspec
import pytest
import torch

from streamrft.consumers.algorithms.aggregation import LOSS_AGG, aggregate, normaliser
from streamrft.consumers.algorithms.step import BatchShare
from streamrft.consumers.batching import collate
from streamrft.consumers.distributed import (
    _DECODER,
    _ENCODER,
    Gather,
    Ranks,
    RankShare,
    Stop,
    TrainStep,
)
from streamrft.consumers.fsdp_engine import IndexedOptimizerState
from tests.helpers.groups import make_group

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
CPU = torch.device("cpu")


def _batch():
    masks = [[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]]
    tokens = [[1, 5, 6, 7, 8, 9, 10]] * 5
    groups = [make_group("r", "t", 0, 5, tokens=tokens, logprobs=[[-1.0] * 3] * 5, masks=masks)]
    return collate([e for g in groups for e in g.experiences], 0)


@pytest.mark.parametrize("mode", list(LOSS_AGG))
@pytest.mark.parametrize("world", [2, 3, 4, 6])
@pytest.mark.parametrize("micro", [(0, 5), (0, 2), (2, 5), (4, 5), (1, 2)])
def test_the_ranks_split_each_micro_batch_and_its_weight(mode, world, micro):
    """Every row of a micro-batch is trained by exactly one rank (or by a weight-0 stand-in),
    and the ranks' weights (over ``world``, which FSDP's mean divides back out) add up to
    the single process's weight of the micro-batch: its share of the batch's normaliser."""
    batch = _batch()
    lo, hi = micro
    parts = [RankShare(Ranks(r, world, CPU), mode).rows(batch, lo, hi) for r in range(world)]
    trained = [i for a, b, part, _ in parts if part for i in range(a, b)]
    assert len(trained) == len(set(trained))  # no row twice
    assert {i for i in range(lo, hi) if batch.response_mask[i].sum() > 0} <= set(trained)
    whole = normaliser(batch.response_mask, mode)
    for a, b, part, share_whole in parts:
        assert lo <= a < b <= hi and share_whole > 0
        if part:  # a weight in proportion to the rows' share of the batch's normaliser
            mine = normaliser(batch.response_mask[a:b], mode)
            assert part / share_whole == pytest.approx(world * mine / whole)
    one_lo, one_hi, one_part, one_whole = BatchShare(mode).rows(batch, lo, hi)
    assert (one_lo, one_hi) == (lo, hi)
    assert one_part / one_whole == pytest.approx(
        normaliser(batch.response_mask[lo:hi], mode) / whole
    )
    total_weight = sum(part / whole for _, _, part, whole in parts) / world
    assert total_weight == pytest.approx(one_part / one_whole)


@pytest.mark.parametrize("mode", list(LOSS_AGG))
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(
    "slices", [[(0, 5)], [(0, 1), (1, 4), (4, 5)], [(0, 2), (2, 3), (3, 5)], [(0, 4), (4, 5)]]
)
def test_weighed_parts_add_up_to_the_whole_batch_aggregate(mode, world, slices):
    """Uneven micro-batches, each split over ranks: the parts' aggregates, weighed as the
    step weighs them, sum to the whole batch's aggregate, for every loss aggregation
    mode (a mode registered without the right normaliser fails here)."""
    batch = _batch()
    values = torch.linspace(-2.0, 3.0, 15).reshape(5, 3)
    total = 0.0
    for lo, hi in slices:
        for r in range(world):
            share = RankShare(Ranks(r, world, CPU), mode) if world > 1 else BatchShare(mode)
            a, b, part, whole = share.rows(batch, lo, hi)
            value = aggregate(values[a:b], batch.response_mask[a:b], mode)
            total += float(value) * part / whole / world
    assert total == pytest.approx(float(aggregate(values, batch.response_mask, mode)), abs=1e-6)


def test_a_rank_with_no_rows_of_a_micro_batch_runs_one_with_weight_zero():
    batch = _batch()
    parts = [RankShare(Ranks(r, 3, CPU), "token-mean").rows(batch, 3, 5) for r in range(3)]
    assert parts[0] == (3, 4, 0.0, 1.0)  # the micro-batch's first row, weighed 0
    assert [p[:2] for p in parts[1:]] == [(3, 4), (4, 5)]


def test_normaliser_counts_what_each_mode_divides_by():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert normaliser(mask, "token-mean") == 3.0
    assert normaliser(mask, "seq-mean-token-mean") == 2.0
    assert normaliser(mask, "seq-mean-token-sum") == 2.0
    assert normaliser(mask, "seq-mean-token-sum-norm") == 2.0  # times its constant length


def test_commands_round_trip_as_msgpack_with_the_groups_in_their_wire_types():
    groups = [make_group("r", f"t{i}", 3) for i in range(3)]
    for command in (TrainStep(3, groups), Gather(), Stop()):
        data = _ENCODER.encode(command)
        assert _DECODER.decode(data) == command
    with pytest.raises(msgspec.ValidationError):
        _DECODER.decode(_ENCODER.encode({"type": "train_step", "version": "x", "groups": []}))


def test_optimizer_state_by_name_and_by_index_are_one_state():
    """``get_optimizer_state_dict``'s layout (by parameter name) and the ``torch`` engine's
    checkpoint layout (by index in optimizer order) convert into each other."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    indexed = opt.state_dict()
    by_name = {
        "state": {names[i]: s for i, s in indexed["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]
        ],
    }
    converted = IndexedOptimizerState.of(by_name).state_dict()
    assert converted["param_groups"] == indexed["param_groups"]
    assert converted["state"].keys() == indexed["state"].keys()
    for i, state in indexed["state"].items():
        for key, value in state.items():
            assert torch.equal(converted["state"][i][key], value)
    back = IndexedOptimizerState(indexed).by_name(names)
    assert back["param_groups"] == by_name["param_groups"]
    assert list(back["state"]) == list(by_name["state"])
