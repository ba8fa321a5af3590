"""Advantages and policy losses against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from streamrft.consumers.algorithms.advantages import group_advantages
from streamrft.consumers.algorithms.aggregation import aggregate
from streamrft.consumers.algorithms.kl import kl_k3
from streamrft.consumers.algorithms.policy_losses import clipped_surrogate
from streamrft.consumers.losses import sft_loss

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)


# -- advantages ------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv = group_advantages(rewards)
    # row 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.8660
    # row 1: mean 0.75, centred (-0.75 x3, 2.25), std sqrt((3 * 0.5625 + 5.0625) / 3) = 1.5
    expected = torch.tensor([[0.8660, -0.8660, -0.8660, 0.8660], [-0.5, -0.5, -0.5, 1.5]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


def test_group_advantages_equal_rewards_give_zero():
    adv = group_advantages(torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(2, 3))
    assert torch.isfinite(adv).all()


def test_group_advantages_without_std_normalisation():
    adv = group_advantages(
        torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]]), std_normalize=False
    )
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.75, -0.75, -0.75, 2.25]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_group_advantages_single_rollout_and_bad_shape():
    assert torch.equal(group_advantages(torch.tensor([[5.0], [1.0]])), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="groups, repeat_times"):
        group_advantages(torch.tensor([1.0, 0.0]))


# -- aggregation -----------------------------------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row has no trained token


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),  # 7/3 over the three unmasked tokens
        ("seq-mean-token-mean", (1.5 + 4.0) / 2),  # row means 1.5 and 4; empty row excluded
        ("seq-mean-token-sum", (3.0 + 4.0) / 2),  # row sums 3 and 4; empty row excluded
    ],
)
def test_aggregate_modes(mode, expected):
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(expected, abs=1e-6)


def test_aggregate_all_masked_is_zero_not_nan():
    zero = torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate(VALUES[:2], zero, mode).item() == 0.0


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate(VALUES, MASK, "seq-sum")


# -- clipped surrogate -----------------------------------------------------------------------

# One token per case, old log-prob 0 so ratio = exp(logprob). clip 0.2: range [0.8, 1.2].
#   ratio  adv   unclipped  clipped  min    per-token loss  clipped?
#   1.1    +1     1.1       1.1      1.1    -1.1            no (inside)
#   1.5    +1     1.5       1.2      1.2    -1.2            yes
#   0.5    +1     0.5       0.8      0.5    -0.5            no (pessimistic side)
#   0.5    -1    -0.5      -0.8     -0.8     0.8            yes
#   1.5    -1    -1.5      -1.2     -1.5     1.5            no (pessimistic side)
#   0.9    -1    -0.9      -0.9     -0.9     0.9            no (inside)
RATIOS = [1.1, 1.5, 0.5, 0.5, 1.5, 0.9]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
PER_TOKEN = [-1.1, -1.2, -0.5, 0.8, 1.5, 0.9]
CLIPPED = [False, True, False, True, False, False]


def _surrogate_inputs(ratios=RATIOS, advs=ADVS):
    logp = torch.tensor([[math.log(r)] for r in ratios], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[a] for a in advs], dtype=torch.float64)
    return logp, old, adv


def test_clipped_surrogate_hand_computed():
    logp, old, adv = _surrogate_inputs()
    mask = torch.ones_like(adv)
    loss, diag = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(sum(PER_TOKEN) / 6, abs=1e-9)
    assert diag["clip_frac"] == pytest.approx(2 / 6)
    expected_kl = sum(0.5 * math.log(r) ** 2 for r in RATIOS) / 6
    assert diag["approx_kl_old"] == pytest.approx(expected_kl, rel=1e-9)


@pytest.mark.parametrize("index", range(6))
def test_clipped_surrogate_each_case(index):
    logp, old, adv = _surrogate_inputs([RATIOS[index]], [ADVS[index]])
    loss, diag = clipped_surrogate(logp, old, adv, torch.ones_like(adv))
    assert loss.item() == pytest.approx(PER_TOKEN[index], abs=1e-9)
    assert diag["clip_frac"] == (1.0 if CLIPPED[index] else 0.0)


def test_clipped_surrogate_asymmetric_range():
    # clip_low 0.1, clip_high 0.3: range [0.9, 1.3]
    logp, old, adv = _surrogate_inputs([1.5, 0.5, 1.25], [1.0, -1.0, 1.0])
    loss, diag = clipped_surrogate(
        logp, old, adv, torch.ones_like(adv), clip_low=0.1, clip_high=0.3, agg="seq-mean-token-sum"
    )
    # per token: -min(1.5, 1.3) = -1.3; -min(-0.5, -0.9) = 0.9; -1.25 (inside)
    assert loss.item() == pytest.approx((-1.3 + 0.9 - 1.25) / 3, abs=1e-9)
    assert diag["clip_frac"] == pytest.approx(2 / 3)


def test_clipped_surrogate_ignores_masked_tokens():
    logp, old, adv = _surrogate_inputs([*RATIOS, 50.0], [*ADVS, 1.0])
    mask = torch.ones_like(adv)
    mask[-1] = 0
    loss, diag = clipped_surrogate(logp, old, adv, mask)
    assert loss.item() == pytest.approx(sum(PER_TOKEN) / 6, abs=1e-9)
    assert diag["clip_frac"] == pytest.approx(2 / 6)


def test_clipped_tokens_get_zero_gradient():
    logp, old, adv = _surrogate_inputs()
    loss, _ = clipped_surrogate(logp, old, adv, torch.ones_like(adv))
    loss.backward()
    grad = logp.grad.squeeze(-1)
    # d(-ratio * adv)/d(logp) = -ratio * adv, divided by the 6 tokens of token-mean
    for i, (r, a, was_clipped) in enumerate(zip(RATIOS, ADVS, CLIPPED, strict=True)):
        expected = 0.0 if was_clipped else -r * a / 6
        assert grad[i].item() == pytest.approx(expected, abs=1e-12), i
    assert (grad[torch.tensor(CLIPPED)] == 0).all()
    assert (grad[~torch.tensor(CLIPPED)] != 0).all()


def test_surrogate_on_policy_gradient_is_minus_advantage():
    # ratio 1 everywhere: the loss is -mean(adv) and the gradient -adv / n (policy gradient)
    adv = torch.tensor([[1.0, -2.0], [0.5, 0.0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    loss, diag = clipped_surrogate(logp, logp.detach().clone(), adv, torch.ones_like(adv))
    loss.backward()
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5 + 0.0) / 4)
    torch.testing.assert_close(logp.grad, -adv / 4)
    assert diag == {"clip_frac": 0.0, "approx_kl_old": 0.0}


# -- KL and SFT ------------------------------------------------------------------------------


def test_kl_k3_values():
    logp = torch.tensor([math.log(0.5), math.log(0.5), math.log(0.3)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(1.0), math.log(0.3)], dtype=torch.float64)
    # r = ref - logp: log 0.5 -> 0.5 - log 0.5 - 1 = 0.193147; log 2 -> 2 - log 2 - 1 = 0.306853
    expected = torch.tensor([0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 0.0], dtype=torch.float64)
    torch.testing.assert_close(kl_k3(logp, ref), expected)


def test_kl_k3_zero_at_equality_and_non_negative():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 16, generator=gen)
    assert torch.equal(kl_k3(logp, logp), torch.zeros_like(logp))
    values = kl_k3(logp, torch.randn(64, 16, generator=gen) * 3)
    assert (values >= 0).all()
    assert (values > 0).any()


def test_kl_k3_expectation_is_the_exact_kl():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    expected = (p * (p / q).log()).sum()  # KL(p || q) with the policy p sampling
    assert (p * kl_k3(p.log(), q.log())).sum().item() == pytest.approx(expected.item(), rel=1e-12)


def test_sft_loss_matches_cross_entropy_on_masked_positions():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 4), generator=gen)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]])
    keep = mask.bool()
    expected = F.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(sft_loss(logits, targets, mask), expected)
    # and it is not the unmasked mean
    assert not torch.allclose(
        sft_loss(logits, targets, mask),
        F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1)),
    )
