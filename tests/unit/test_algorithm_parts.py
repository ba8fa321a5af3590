"""Every part of ``consumers/algorithms`` against hand-derived values on small tensors with
masks and padding (a padded row, a row with no trained token, groups of unequal size),
and, where verl defines the same thing (``verl/trainer/ppo/core_algos.py``), against an
independent transcription of verl's formula on the same random tensors.

The ``verl_*`` functions below restate verl's definitions as formulas (loops over groups
and tokens, not our vectorised code), so a mistake in our vectorisation shows as a
mismatch. Where we deliberately differ from verl, the test says how and asserts ours.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from streamrft.consumers.algorithms.advantages import (
    ADVANTAGES,
    WHITEN_EPS,
    AdvantageInputs,
    masked_whiten,
    token_rewards,
)
from streamrft.consumers.algorithms.aggregation import (
    LOSS_AGG,
    aggregate,
    aggregation_of,
    normaliser,
)
from streamrft.consumers.algorithms.corrections import CORRECTIONS, MAX_LOG_WEIGHT, correct
from streamrft.consumers.algorithms.kl import KL_ESTIMATORS, LOW_VAR_KL_BOUND
from streamrft.consumers.algorithms.policy_losses import POLICY_LOSSES, LossInputs
from streamrft.consumers.algorithms.spec import AlgorithmSpec

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)
F64 = torch.float64

# -- a small batch with padding ----------------------------------------------------------------

SIZES = [3, 1, 2]
"""Groups of unequal size, one of a single rollout."""
REWARDS = torch.tensor([1.0, 0.0, 2.0, 5.0, 1.0, 3.0], dtype=F64)
MASK = torch.tensor(
    [
        [1, 1, 1, 1],  # full
        [1, 1, 0, 0],  # padded after two tokens
        [0, 0, 0, 0],  # no trained token (its reward still counts in its group's mean)
        [1, 1, 1, 0],  # the group of one
        [1, 0, 0, 0],  # one token
        [0, 1, 1, 0],  # its first token not trained (an observation), then padding
    ],
    dtype=F64,
)
PENALTY = torch.tensor([[0.1 * (t + 1) for t in range(4)]] * 6, dtype=F64)
"""A per-token KL penalty (already weighed), 0.1 0.2 0.3 0.4 on every row."""
LAST = [3, 1, None, 2, 0, 2]
"""Each row's last trained token (None: it has none)."""


def inputs(penalty: torch.Tensor | None = None, rewards=REWARDS, sizes=SIZES, mask=MASK):
    return AdvantageInputs(rewards, sizes, mask, penalty)


def spread(per_row: list[float], mask: torch.Tensor = MASK) -> torch.Tensor:
    """One value per row over its trained tokens."""
    return torch.tensor(per_row, dtype=F64)[:, None] * mask


def adv(name: str, inp: AdvantageInputs, **spec) -> torch.Tensor:
    return ADVANTAGES[name](inp, AlgorithmSpec(**spec))


# -- token rewards and the KL penalty -------------------------------------------------------------


def test_the_reward_sits_on_the_last_trained_token():
    expected = torch.zeros(6, 4, dtype=F64)
    for row, last in enumerate(LAST):
        if last is not None:
            expected[row, last] = REWARDS[row]
    # row 1: its reward 0 on token 1; row 2: nowhere (no trained token); row 5: token 2
    assert torch.equal(inputs().token_rewards, expected)
    assert torch.equal(token_rewards(REWARDS, MASK), expected)


def test_the_kl_penalty_comes_off_every_trained_token_and_off_the_score():
    inp = inputs(PENALTY)
    expected = torch.zeros(6, 4, dtype=F64)
    for row, last in enumerate(LAST):
        if last is not None:
            expected[row, last] = REWARDS[row]
    expected -= PENALTY * MASK
    torch.testing.assert_close(inp.token_rewards, expected, rtol=0, atol=1e-12)
    # score = reward - the penalty summed over trained tokens
    scores = [1 - 1.0, 0 - 0.3, 2 - 0.0, 5 - 0.6, 1 - 0.1, 3 - 0.5]
    torch.testing.assert_close(inp.scores, torch.tensor(scores, dtype=F64), rtol=0, atol=1e-12)
    # and the score is the sum of the token rewards wherever a row has a trained token
    has = MASK.sum(1) > 0
    torch.testing.assert_close(inp.token_rewards.sum(1)[has], inp.scores[has])
    assert torch.equal(inputs().scores, REWARDS)  # no penalty: the reward


# -- advantage estimators -----------------------------------------------------------------------


def test_grpo_with_std():
    # group [1, 0, 2]: mean 1, unbiased std 1; the group of one: 0 (no signal); group
    # [1, 3]: mean 2, std sqrt(2)
    eps = 1e-6
    expected = spread(
        [0.0, -1 / (1 + eps), 1 / (1 + eps), 0.0, -1 / (2**0.5 + eps), 1 / (2**0.5 + eps)]
    )
    torch.testing.assert_close(adv("grpo", inputs()), expected, rtol=0, atol=1e-12)


def test_grpo_without_std_is_dr_grpo_centring():
    expected = spread([0.0, -1.0, 1.0, 0.0, -1.0, 1.0])
    assert torch.equal(adv("grpo", inputs(), std_normalize=False), expected)


def test_grpo_uses_the_penalised_scores():
    # scores [0, -0.3, 2], [4.4], [0.9, 2.5]
    expected = spread([(0 - 1.7 / 3), (-0.3 - 1.7 / 3), (2 - 1.7 / 3), 0.0, -0.8, 0.8])
    result = adv("grpo", inputs(PENALTY), std_normalize=False)
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-12)


def test_rloo_leaves_one_out():
    # rollout minus the mean of the others: 1 - 1 = 0, 0 - 1.5, 2 - 0.5; G=1: 0; 1 - 3, 3 - 1
    expected = spread([0.0, -1.5, 1.5, 0.0, -2.0, 2.0])
    torch.testing.assert_close(adv("rloo", inputs()), expected, rtol=0, atol=1e-12)
    with_penalty = adv("rloo", inputs(PENALTY))  # scores 0.9 and 2.5 in the last group
    torch.testing.assert_close(with_penalty[4:], spread([-1.6, 1.6], MASK[4:]), rtol=0, atol=1e-12)


def test_rloo_of_single_rollouts_is_zero():
    inp = inputs(rewards=torch.tensor([4.0, -1.0], dtype=F64), sizes=[1, 1], mask=MASK[:2])
    assert torch.equal(adv("rloo", inp), torch.zeros(2, 4, dtype=F64))


def test_reinforce_plus_plus_returns_then_whitening():
    # returns (reward on the last trained token, summed from each token to the end):
    # [1 1 1 1], [0 0 . .], none, [5 5 5 .], [1 . . .], [. 3 3 .]
    returns = torch.tensor(
        [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [5, 5, 5, 0], [1, 0, 0, 0], [3, 3, 3, 0]],
        dtype=F64,
    )
    trained = [1, 1, 1, 1, 0, 0, 5, 5, 5, 1, 3, 3]  # the returns of the trained tokens
    mean, var = statistics.mean(trained), statistics.variance(trained)  # unbiased
    expected = (returns - mean) / math.sqrt(var + WHITEN_EPS) * MASK
    result = adv("reinforce_plus_plus", inputs())
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-12)
    # whitened: mean 0 and unbiased std 1 over the trained tokens
    values = result[MASK > 0]
    assert float(values.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(values.std()) == pytest.approx(1.0, abs=1e-6)


def test_reinforce_plus_plus_returns_count_the_penalty_of_later_tokens():
    # one row, penalty 0.1 0.2 0.3 0.4 on 4 trained tokens, reward 1:
    # token rewards [-0.1, -0.2, -0.3, 0.6] -> returns [0, 0.1, 0.3, 0.6]
    # (another row of zeros, so the whitening has something to compare with)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=F64)
    inp = inputs(PENALTY[:2], torch.tensor([1.0, 0.0], dtype=F64), [2], mask)
    # row 1, reward 0, penalty 0.1 0.2 on its two tokens: returns [-0.3, -0.2]
    returns = torch.tensor([[0.0, 0.1, 0.3, 0.6], [-0.3, -0.2, 0, 0]], dtype=F64)
    trained = [0.0, 0.1, 0.3, 0.6, -0.3, -0.2]
    mean, var = statistics.mean(trained), statistics.variance(trained)
    expected = (returns - mean) / math.sqrt(var + WHITEN_EPS) * mask
    torch.testing.assert_close(adv("reinforce_plus_plus", inp), expected, rtol=0, atol=1e-12)


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens():
    # group-centred scores [0, -1, 1], [0], [-1, 1] over the trained tokens
    centred = [0.0, -1.0, 1.0, 0.0, -1.0, 1.0]
    trained = [0, 0, 0, 0, -1, -1, 0, 0, 0, -1, 1, 1]
    mean, var = statistics.mean(trained), statistics.variance(trained)
    expected = (spread(centred) - mean) / math.sqrt(var + WHITEN_EPS) * MASK
    result = adv("reinforce_plus_plus_baseline", inputs())
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-12)


def test_opmd_centres_on_the_group_mean_without_scaling():
    expected = spread([0.0, -1.0, 1.0, 0.0, -1.0, 1.0])
    assert torch.equal(adv("opmd", inputs()), expected)
    # the std setting is grpo's, not opmd's
    assert torch.equal(adv("opmd", inputs(), std_normalize=True), expected)


def test_none_gives_zeros():
    result = adv("none", inputs(PENALTY))
    assert result.shape == MASK.shape and torch.equal(result, torch.zeros_like(MASK))


OUTCOME_ESTIMATORS = [
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "opmd",
    "none",
]
"""The estimators of rewards alone, tested here (``distill``, which needs a teacher's
log-probs, has its own tests)."""


@pytest.mark.parametrize("name", OUTCOME_ESTIMATORS)
def test_every_estimator_is_zero_off_the_mask(name):
    result = adv(name, inputs(PENALTY))
    assert result.shape == MASK.shape
    assert torch.equal(result[MASK == 0], torch.zeros_like(result[MASK == 0]))
    assert torch.isfinite(result).all()


def test_masked_whiten_of_a_constant_is_zero_not_nan():
    values = torch.full((2, 3), 4.0, dtype=F64)
    assert torch.equal(masked_whiten(values, MASK[:2, :3]), torch.zeros(2, 3, dtype=F64))
    assert torch.equal(masked_whiten(values, torch.zeros(2, 3)), torch.zeros(2, 3, dtype=F64))


# -- the same estimators as verl defines them -----------------------------------------------------


def verl_token_level_rewards(rewards, mask, penalty=None):
    """verl's token-level rewards: the score at the last valid response token
    (``valid_response_length - 1``, a prefix mask), minus ``kl_coef x kld x mask``
    (``apply_kl_penalty``; the weight is already in ``penalty``)."""
    out = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        out[i, int(mask[i].sum()) - 1] = rewards[i]
    return out if penalty is None else out - penalty * mask


def verl_masked_whiten(values, mask):
    """verl ``masked_whiten``: (values - masked mean) x rsqrt(unbiased masked var + 1e-8)."""
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = (((values - mean) ** 2) * mask).sum() / n * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_grpo(token_level_rewards, mask, index, epsilon=1e-6, norm_by_std=True):
    """verl ``compute_grpo_outcome_advantage``: score = sum of token rewards; per group
    ``(score - mean) / (std + eps)`` (torch.std, unbiased), or ``score - mean``; a group of
    one has mean 0 and std 1."""
    scores = token_level_rewards.sum(-1)
    out = torch.zeros_like(scores)
    for i in range(len(scores)):
        group = torch.stack([scores[j] for j in range(len(scores)) if index[j] == index[i]])
        mean, std = (group.mean(), group.std()) if len(group) > 1 else (0.0, 1.0)
        out[i] = (scores[i] - mean) / (std + epsilon) if norm_by_std else scores[i] - mean
    return out[:, None] * mask


def verl_rloo(token_level_rewards, mask, index):
    """verl ``compute_rloo_outcome_advantage``: ``score x G/(G-1) - mean x G/(G-1)``; a
    group of one keeps its score."""
    scores = token_level_rewards.sum(-1)
    out = scores.clone()
    for i in range(len(scores)):
        group = torch.stack([scores[j] for j in range(len(scores)) if index[j] == index[i]])
        g = len(group)
        if g > 1:
            out[i] = scores[i] * g / (g - 1) - group.mean() * g / (g - 1)
    return out[:, None] * mask


def verl_reinforce_plus_plus(token_level_rewards, mask, gamma=1.0):
    """verl ``compute_reinforce_plus_plus_outcome_advantage``: the discounted return from
    each token, reset after the end of the response, whitened over the mask."""
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros(mask.shape[0], dtype=mask.dtype)
    for t in reversed(range(mask.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask


def verl_reinforce_plus_plus_baseline(token_level_rewards, mask, index):
    """verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``: score minus its
    group's mean (0 for a group of one), over the tokens, whitened over the mask."""
    scores = token_level_rewards.sum(-1)
    centred = torch.zeros_like(scores)
    for i in range(len(scores)):
        group = torch.stack([scores[j] for j in range(len(scores)) if index[j] == index[i]])
        centred[i] = scores[i] - (group.mean() if len(group) > 1 else 0.0)
    values = centred[:, None] * mask
    return verl_masked_whiten(values, mask) * mask


def random_batch(seed: int, sizes=(4, 2, 3, 5), width: int = 7):
    """Rewards, prefix masks of random lengths >= 1 (verl's response masks), a penalty, and
    each row's group index, on groups of at least 2 (where verl and we agree)."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    rewards = torch.randn(rows, generator=gen, dtype=F64)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(F64)
    penalty = 0.05 * torch.randn(rows, width, generator=gen, dtype=F64)
    index = [g for g, n in enumerate(sizes) for _ in range(n)]
    return rewards, list(sizes), mask, penalty, index


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_penalty", [False, True])
def test_advantages_match_verls_definitions(seed, with_penalty):
    rewards, sizes, mask, penalty, index = random_batch(seed)
    penalty = penalty if with_penalty else None
    inp = AdvantageInputs(rewards, sizes, mask, penalty)
    tlr = verl_token_level_rewards(rewards, mask, penalty)
    torch.testing.assert_close(inp.token_rewards, tlr, rtol=0, atol=1e-12)
    close = {"rtol": 1e-9, "atol": 1e-9}
    torch.testing.assert_close(adv("grpo", inp), verl_grpo(tlr, mask, index), **close)
    torch.testing.assert_close(
        adv("grpo", inp, std_normalize=False),
        verl_grpo(tlr, mask, index, norm_by_std=False),
        **close,
    )
    torch.testing.assert_close(adv("rloo", inp), verl_rloo(tlr, mask, index), **close)
    torch.testing.assert_close(
        adv("reinforce_plus_plus", inp), verl_reinforce_plus_plus(tlr, mask), **close
    )
    torch.testing.assert_close(
        adv("reinforce_plus_plus_baseline", inp),
        verl_reinforce_plus_plus_baseline(tlr, mask, index),
        **close,
    )


def test_where_we_differ_from_verl_on_groups_of_one_and_interior_masks():
    """Deliberate differences. A group of one: verl's grpo gives the raw score (mean 0,
    std 1) and its rloo keeps the score; ours give 0 (one rollout has nothing to be
    compared with). A token inside the response that is not trained (an observation):
    verl's REINFORCE++ resets the return there (its mask is an end-of-response mask), so
    earlier tokens lose the reward; ours sums every later trained token's reward."""
    rewards = torch.tensor([2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1]], dtype=F64)
    inp = AdvantageInputs(rewards, [1], mask)
    tlr = verl_token_level_rewards(rewards, mask)
    assert torch.equal(adv("grpo", inp), torch.zeros(1, 3, dtype=F64))
    torch.testing.assert_close(
        verl_grpo(tlr, mask, [0]), torch.full((1, 3), 2 / (1 + 1e-6), dtype=F64)
    )
    assert torch.equal(adv("rloo", inp), torch.zeros(1, 3, dtype=F64))
    assert torch.equal(verl_rloo(tlr, mask, [0]), torch.full((1, 3), 2.0, dtype=F64))
    # interior mask [1, 0, 1] with reward 1 on token 2: our returns [1, ., 1], verl's [0, ., 1]
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=F64)
    rewards = torch.tensor([1.0, 0.0], dtype=F64)
    ours = adv("reinforce_plus_plus", AdvantageInputs(rewards, [2], mask))
    trained = [1, 1, 0, 0, 0]
    mean, var = statistics.mean(trained), statistics.variance(trained)
    assert float(ours[0, 0]) == pytest.approx((1 - mean) / math.sqrt(var + WHITEN_EPS))
    assert float(ours[0, 0]) == float(ours[0, 2])


# -- policy losses ------------------------------------------------------------------------------


def loss(name: str, logp, old, advantages, mask, **spec):
    return POLICY_LOSSES[name](LossInputs(logp, old, advantages, mask), AlgorithmSpec(**spec))


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


def test_ppo_clip_per_token_with_an_asymmetric_range_and_a_mask():
    # old log-probs 0, so ratio = exp(logp); range [0.9, 1.3]
    ratios = [[1.5, 0.5, 1.25, 2.0], [0.8, 1.1, 3.0, 1.0]]
    advantages = torch.tensor([[1.0, -1.0, 1.0, 1.0], [1.0, -1.0, -1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=F64)  # the last column: padding
    logp = leaf([[math.log(r) for r in row] for row in ratios])
    old = torch.zeros(2, 4, dtype=F64)
    per_token, info = loss("ppo_clip", logp, old, advantages, mask, clip_low=0.1, clip_high=0.3)
    # -min(r A, clip(r) A): 1.5,+ -> -1.3 (clipped); 0.5,- -> -min(-0.5, -0.9) = 0.9 (clipped);
    # 1.25,+ -> -1.25; [pad]; 0.8,+ -> -0.8 (pessimistic side, not clipped); 1.1,- -> 1.1;
    # 3.0,- -> 3.0 (pessimistic side)
    expected = [[-1.3, 0.9, -1.25], [-0.8, 1.1, 3.0]]
    torch.testing.assert_close(per_token[:, :3], torch.tensor(expected, dtype=F64))
    assert info["clip_frac"] == pytest.approx(2 / 6)  # over the 6 trained tokens
    assert info["approx_kl_old"] == pytest.approx(
        sum(0.5 * math.log(r) ** 2 for row in ratios for r in row[:3]) / 6
    )
    (per_token * mask).sum().backward()
    # clipped tokens: no gradient; the others d(-r A)/dlogp = -r A
    expected_grad = [[0.0, 0.0, -1.25, 0.0], [-0.8, 1.1, 3.0, 0.0]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=F64))


def test_gspo_uses_one_sequence_ratio_and_each_tokens_own_gradient():
    old = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    delta = [[0.3, -0.1, 0.1, 5.0], [0.0, 0.02, -0.01, 0.0]]  # logp - old; row 0's last: padding
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]], dtype=F64)
    logp = leaf((old + torch.tensor(delta, dtype=F64)).tolist())
    a = torch.tensor([[2.0], [-1.0]], dtype=F64) * mask
    per_token, info = loss("gspo", logp, old, a, mask, clip_low=0.05, clip_high=0.05)
    # sequence ratios: exp(mean of the trained tokens' log-ratios), the padding left out
    s0 = math.exp((0.3 - 0.1 + 0.1) / 3)  # 1.105: above 1.05, clipped for A > 0
    s1 = math.exp((0.02 - 0.01) / 2)  # 1.005: inside
    expected = torch.tensor([[-2 * 1.05] * 4, [s1] * 4], dtype=F64) * mask
    torch.testing.assert_close(per_token * mask, expected)
    assert info["clip_frac"] == pytest.approx(3 / 5)
    # gradient: token t's loss -A s pi_t / sg(pi_t) moves only logp_t, by -A s (0 if clipped)
    per_token[1, 1].backward(retain_graph=True)
    grad = torch.zeros(2, 4, dtype=F64)
    grad[1, 1] = s1  # -A s with A = -1
    torch.testing.assert_close(logp.grad, grad)
    logp.grad = None
    (per_token * mask).sum().backward()
    grad = torch.tensor([[0.0] * 4, [0.0, s1, s1, 0.0]], dtype=F64)  # row 0 clipped
    torch.testing.assert_close(logp.grad, grad)
    assert s0 > 1.05


def verl_gspo(old, logp, advantages, mask, clip_low, clip_high):
    """verl ``compute_policy_loss_gspo``: s_i = exp(sum of masked log-ratios / max(len, 1));
    per token log s_it = sg(log s_i) + logp - sg(logp), clamped at 10; loss
    ``max(-A s_it, -A clip(s_it))`` aggregated seq-mean-token-mean (verl's ``agg_loss``)."""
    lengths = mask.sum(-1).clamp(min=1)
    seq = ((logp - old) * mask).sum(-1) / lengths
    log_s = (logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    losses = torch.maximum(-advantages * s, -advantages * s.clamp(1 - clip_low, 1 + clip_high))
    return verl_agg_loss(losses, mask, "seq-mean-token-mean")


@pytest.mark.parametrize("seed", range(3))
def test_gspo_matches_verl_in_value_and_gradient(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 6, generator=gen, dtype=F64) * 3
    base = old + 0.05 * torch.randn(5, 6, generator=gen, dtype=F64)
    lengths = torch.tensor([6, 3, 1, 5, 2])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).to(F64)
    a = torch.randn(5, 1, generator=gen, dtype=F64) * mask
    ours_logp = base.clone().requires_grad_(True)
    per_token, _ = loss("gspo", ours_logp, old, a, mask, clip_low=3e-3, clip_high=4e-3)
    ours = aggregate(per_token, mask, "seq-mean-token-mean")
    ours.backward()
    verl_logp = base.clone().requires_grad_(True)
    theirs = verl_gspo(old, verl_logp, a, mask, 3e-3, 4e-3)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_logp.grad, verl_logp.grad, rtol=1e-12, atol=1e-12)
    trained = verl_logp.grad[mask > 0]
    assert (trained == 0).any() and (trained != 0).any()  # some rows clipped, some not


def test_cispo_weight_is_clipped_and_detached():
    # ratios 2.0 (weight capped at 1 + 0.28), 0.5 (floored at 1 - 0.2), 1.1 (as is)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    logp = leaf([[-1.0 + math.log(2.0), -1.0 + math.log(0.5), -1.0 + math.log(1.1), -3.0]])
    a = torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    per_token, info = loss("cispo", logp, old, a, mask, clip_low=0.2, clip_high=0.28)
    w = torch.tensor([[1.28, 0.8, 1.1, 0.8]], dtype=F64)  # the last: ratio e^-2, floored
    torch.testing.assert_close(per_token, -w * a * logp.detach())
    assert info["clip_frac"] == pytest.approx(2 / 3)
    (per_token * mask).sum().backward()
    # the gradient on log pi is -w A for every trained token, clipped ones included
    torch.testing.assert_close(logp.grad, (-w * a * mask))
    assert (logp.grad[0, :2] != 0).all()


def verl_cispo(old, logp, advantages, clip_low, clip_high):
    """CISPO as verl (and MiniMax-M1 eq. 4-5) defines it, per token:
    ``-sg(clip(exp(logp - old), 1 - eps_low, 1 + eps_high)) x A x logp``."""
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    return -ratio.clamp(1 - clip_low, 1 + clip_high).detach() * advantages * logp


def test_cispo_matches_verl():
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(4, 5, generator=gen, dtype=F64) * 2
    base = old + 0.5 * torch.randn(4, 5, generator=gen, dtype=F64)
    a = torch.randn(4, 5, generator=gen, dtype=F64)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).to(F64)
    ours_logp, verl_logp = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    ours, _ = loss("cispo", ours_logp, old, a, mask, clip_low=1.0, clip_high=0.28)
    theirs = verl_cispo(old, verl_logp, a, 1.0, 0.28)
    torch.testing.assert_close(ours, theirs)
    aggregate(ours, mask, "token-mean").backward()
    verl_agg_loss(theirs, mask, "token-mean").backward()
    torch.testing.assert_close(ours_logp.grad, verl_logp.grad)


def test_opmd_policy_gradient_plus_the_squared_log_ratio():
    """Kimi k1.5's mirror-descent gradient (sec. 2.3): ``(r - mean) grad log pi - tau/2
    grad (log pi / pi_old)^2``. Trinity-RFT's ``OPMDPolicyLossFn`` keeps only the first
    term, scaled by 1 / (1 + tau): the second one's gradient is 0 on-policy (pi = pi_old),
    so the two differ only after the first update of a step (and by that scale)."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    logp = leaf([[-0.8, -2.5, -0.5]])
    a = torch.tensor([[1.0, -0.5, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=F64)
    per_token, info = loss("opmd", logp, old, a, mask, opmd_tau=0.5)
    # -A logp + tau/2 (logp - old)^2
    expected = [0.8 + 0.25 * 0.04, -1.25 + 0.25 * 0.25, 1.0]
    torch.testing.assert_close(per_token, torch.tensor([expected], dtype=F64))
    (per_token * mask).sum().backward()
    # gradient -A + tau (logp - old)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0 + 0.1, 0.5 - 0.25, 0.0]], dtype=F64))
    assert info["approx_kl_old"] == pytest.approx((0.5 * 0.04 + 0.5 * 0.25) / 2)


def test_sft_is_the_negative_log_likelihood():
    logp = leaf([[-0.5, -2.0, -7.0], [-1.0, -3.0, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=F64)
    a = torch.full((2, 3), 99.0, dtype=F64)  # unused
    per_token, info = loss("sft", logp, logp.detach() - 1.0, a, mask)
    torch.testing.assert_close(per_token, -logp.detach())
    assert info == {"nll": pytest.approx((0.5 + 2.0 + 1.0) / 3)}
    aggregate(per_token, mask, "token-mean").backward()
    torch.testing.assert_close(logp.grad, -mask / 3)


def verl_vanilla_ppo(old, logp, advantages, clip_low, clip_high, clip_ratio_c=3.0):
    """verl ``compute_policy_loss_vanilla`` per token: ``max(-A r, -A clip(r))`` and, for
    A < 0, at most ``-A c`` (dual clip, c = 3)."""
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    clipped = torch.maximum(
        -advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    )
    dual = torch.minimum(-advantages * clip_ratio_c, clipped)
    return torch.where(advantages < 0, dual, clipped)


def test_ppo_clip_matches_verl_below_the_dual_clip():
    """verl's vanilla loss adds a dual clip (ratio 3 for negative advantages); ours is
    PPO's plain clip: they agree wherever the ratio stays below 3."""
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(6, 5, generator=gen, dtype=F64) * 2
    logp = old + 0.4 * torch.randn(6, 5, generator=gen, dtype=F64)
    assert float((logp - old).max()) < math.log(3.0)
    a = torch.randn(6, 5, generator=gen, dtype=F64)
    mask = (torch.rand(6, 5, generator=gen) > 0.2).to(F64)
    ours, _ = loss("ppo_clip", logp, old, a, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(ours, verl_vanilla_ppo(old, logp, a, 0.2, 0.28))
    # above 3 with A < 0 they part: verl caps the loss at -3A, ours keeps -r A
    big = torch.tensor([[math.log(5.0)]], dtype=F64)
    zero, minus = torch.zeros(1, 1, dtype=F64), -torch.ones(1, 1, dtype=F64)
    ours, _ = loss("ppo_clip", big, zero, minus, torch.ones(1, 1))
    assert float(ours) == pytest.approx(5.0)
    assert float(verl_vanilla_ppo(zero, big, minus, 0.2, 0.2)) == pytest.approx(3.0)


# -- KL estimators --------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    logp = torch.tensor([math.log(0.5), math.log(0.5), math.log(0.3)], dtype=F64)
    ref = torch.tensor([math.log(0.25), math.log(1.0), math.log(0.3)], dtype=F64)
    ln2 = math.log(2)
    expected = {
        "k1": [ln2, -ln2, 0.0],
        "k2": [0.5 * ln2**2, 0.5 * ln2**2, 0.0],
        # r = ref - logp = -ln2, ln2: e^r - r - 1
        "k3": [0.5 + ln2 - 1, 2 - ln2 - 1, 0.0],
        "low_var_kl": [0.5 + ln2 - 1, 2 - ln2 - 1, 0.0],
        "abs": [ln2, ln2, 0.0],
    }
    for name, values in expected.items():
        result = KL_ESTIMATORS[name](logp, ref)
        torch.testing.assert_close(result, torch.tensor(values, dtype=F64), msg=name)


def test_low_var_kl_is_clamped_and_k3_is_not():
    logp = torch.tensor([0.0, 0.0, -30.0], dtype=F64)
    ref = torch.tensor([30.0, -30.0, 0.0], dtype=F64)
    low_var = KL_ESTIMATORS["low_var_kl"](logp, ref)
    assert torch.equal(low_var, torch.full((3,), LOW_VAR_KL_BOUND, dtype=F64))
    k3 = KL_ESTIMATORS["k3"](logp, ref)
    torch.testing.assert_close(k3[1], torch.tensor(math.exp(-30) + 30 - 1, dtype=F64))
    assert float(k3[0]) > 1e12  # e^30 - 31
    assert torch.isfinite(low_var).all()


def verl_kl_penalty(logprob, ref_logprob, kind):
    """verl ``kl_penalty``: k1 ``logp - ref``; abs ``|logp - ref|``; k2/mse
    ``(logp - ref)^2 / 2``; k3/low_var_kl ``clamp(e^r - r - 1, -10, 10)`` with ``r =
    clamp(ref - logp, -20, 20)``."""
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob) ** 2
    r = (ref_logprob - logprob).clamp(-20, 20)
    return (torch.exp(r) - r - 1).clamp(-10, 10)


@pytest.mark.parametrize(
    ("ours", "verls"),
    [("k1", "k1"), ("k2", "k2"), ("abs", "abs"), ("low_var_kl", "low_var_kl"), ("k3", "k3")],
)
def test_kl_estimators_match_verl(ours, verls):
    """verl's ``k3`` is its clamped ``low_var_kl``; ours is the plain k3 (Schulman's),
    equal to it wherever the clamp does not bite (all of this batch)."""
    gen = torch.Generator().manual_seed(6)
    logp = -torch.rand(8, 9, generator=gen, dtype=F64) * 4
    ref = logp + torch.randn(8, 9, generator=gen, dtype=F64)
    torch.testing.assert_close(KL_ESTIMATORS[ours](logp, ref), verl_kl_penalty(logp, ref, verls))


def test_k3_expectation_is_the_exact_kl_and_k1_is_unbiased():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    exact = float((p * (p / q).log()).sum())  # KL(policy p || reference q)
    for name in ("k1", "k3", "low_var_kl"):
        assert float((p * KL_ESTIMATORS[name](p.log(), q.log())).sum()) == pytest.approx(exact)


# -- aggregation ----------------------------------------------------------------------------------

VALUES = torch.tensor(
    [[1.0, 2.0, 3.0, 4.0], [4.0, 5.0, 6.0, 7.0], [7.0, 8.0, 9.0, 1.0], [2.0, 2.0, 2.0, 2.0]],
    dtype=F64,
)
AGG_MASK = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=F64)


def test_seq_mean_token_sum_norm_divides_the_sequence_mean_by_a_constant_length():
    # row sums 3, 4, (empty, left out), 8: mean over the 3 trained rows 5, over length 16
    fn = aggregation_of("seq-mean-token-sum-norm", 16)
    assert float(fn(VALUES, AGG_MASK)) == pytest.approx(5.0 / 16)
    assert float(aggregate(VALUES, AGG_MASK, "seq-mean-token-sum-norm", 16)) == pytest.approx(
        5 / 16
    )
    assert float(aggregate(VALUES, AGG_MASK, "seq-mean-token-sum-norm")) == pytest.approx(5.0)
    # unlike seq-mean-token-mean, a longer right answer is not divided down by its length
    long_and_short = torch.ones(2, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=F64)
    per_row = [float(fn(long_and_short[i : i + 1], mask[i : i + 1])) for i in range(2)]
    assert per_row == pytest.approx([4 / 16, 1 / 16])
    assert float(fn(VALUES, torch.zeros_like(VALUES))) == 0.0


@pytest.mark.parametrize("mode", list(LOSS_AGG))
@pytest.mark.parametrize(
    "cuts", [[(0, 4)], [(0, 1), (1, 3), (3, 4)], [(0, 2), (2, 3), (3, 4)], [(0, 3), (3, 4)]]
)
def test_parts_weighed_by_their_normaliser_give_the_whole(mode, cuts):
    """A batch cut into parts (micro-batches, ranks), each part's value weighed by
    ``normaliser(part) / normaliser(whole)``, gives the whole batch's value and gradient,
    the constant length included."""
    fn = aggregation_of(mode, 16)
    values = VALUES.clone().requires_grad_(True)
    whole = fn(values, AGG_MASK)
    (whole_grad,) = torch.autograd.grad(whole, values)
    total = 0.0
    for lo, hi in cuts:
        total = total + fn(values[lo:hi], AGG_MASK[lo:hi]) * normaliser(
            AGG_MASK[lo:hi], mode
        ) / normaliser(AGG_MASK, mode)
    (parts_grad,) = torch.autograd.grad(total, values)
    assert float(total.detach()) == pytest.approx(float(whole.detach()), rel=1e-12)
    torch.testing.assert_close(parts_grad, whole_grad)


def verl_agg_loss(loss_mat, loss_mask, mode, max_len=None):
    """verl ``agg_loss``: token-mean = masked mean; seq-mean-token-sum = mean over rows of
    row sums; seq-mean-token-mean = mean over rows of row means; seq-mean-token-sum-norm =
    the sum of row sums divided by the mask's width."""
    rows = [(loss_mat[i] * loss_mask[i]).sum() for i in range(loss_mat.shape[0])]
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "seq-mean-token-sum":
        return torch.stack(rows).mean()
    if mode == "seq-mean-token-mean":
        return torch.stack([r / loss_mask[i].sum() for i, r in enumerate(rows)]).mean()
    return torch.stack(rows).sum() / loss_mask.shape[-1]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregation_matches_verl_without_empty_rows(mode):
    """verl averages over every row, so an empty row counts as 0 (token-sum) or NaN
    (token-mean); ours averages over the rows with a trained token. Without empty rows
    they agree."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(5, 6, generator=gen, dtype=F64)
    mask = (torch.rand(5, 6, generator=gen) > 0.4).to(F64)
    mask[:, 0] = 1  # every row has a trained token
    torch.testing.assert_close(aggregate(values, mask, mode), verl_agg_loss(values, mask, mode))


def test_seq_mean_token_sum_norm_differs_from_verl_by_the_sequence_count():
    """verl's ``seq-mean-token-sum-norm`` sums the row sums and divides by the mask's
    width; ours takes their mean over the trained rows (Dr. GRPO's 1/G) and divides by the
    configured length (``algorithm.norm_length``, the longest response allowed, which a
    batch's padded width need not reach). Equal up to the factor rows x width / length."""
    gen = torch.Generator().manual_seed(8)
    values = torch.randn(5, 6, generator=gen, dtype=F64)
    mask = torch.ones(5, 6, dtype=F64)
    ours = aggregate(values, mask, "seq-mean-token-sum-norm", 6)
    theirs = verl_agg_loss(values, mask, "seq-mean-token-sum-norm")
    torch.testing.assert_close(ours * 5, theirs)


# -- off-policy corrections -----------------------------------------------------------------------

W = torch.tensor([[0.5, 1.0, 3.0, 1.5], [2.5, 0.25, 1.0, 1.0], [4.0, 4.0, 4.0, 4.0]], dtype=F64)
"""Token importance weights pi_prox / pi_behaviour; trained: 0.5 1 3 | 2.5 0.25 | none."""
W_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=F64)
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -3.0, -0.5]] * 3, dtype=F64)
PROXIMAL = BEHAVIOUR + W.log()


def corrected(name: str, **spec):
    spec = AlgorithmSpec(off_policy_correction=name, **spec)
    return correct(BEHAVIOUR, PROXIMAL, W_MASK, spec)


def assert_weights(fix, expected):
    torch.testing.assert_close(fix.weights, torch.tensor(expected, dtype=F64))


def test_none_passes_the_behaviour_logprobs_through():
    fix = correct(BEHAVIOUR, PROXIMAL, W_MASK, AlgorithmSpec())
    assert fix.base is BEHAVIOUR and fix.weights is None and fix.metrics == {}
    # no proximal log-probs: the same, whatever the setting
    fix = correct(BEHAVIOUR, None, W_MASK, AlgorithmSpec(off_policy_correction="masked_is_token"))
    assert fix.base is BEHAVIOUR and fix.weights is None


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_a_correction_takes_the_ratio_against_the_proximal_policy(name):
    fix = corrected(name)
    assert fix.base is PROXIMAL
    assert torch.equal(fix.weights * (1 - W_MASK), torch.zeros_like(W))  # 0 off the mask
    # the statistics of the weights before capping or masking, over the 5 trained tokens
    if name.endswith("sequence"):
        return
    assert fix.metrics["is_weight_mean"] == pytest.approx((0.5 + 1 + 3 + 2.5 + 0.25) / 5)
    assert fix.metrics["is_weight_max"] == pytest.approx(3.0)


def test_decoupled_ppo_masks_weights_above_the_cap():
    fix = corrected("decoupled_ppo", is_cap=2.0)
    assert_weights(fix, [[0.5, 1.0, 0.0, 0.0], [0.0, 0.25, 0.0, 0.0], [0.0] * 4])
    assert fix.metrics["is_masked_frac"] == pytest.approx(2 / 5)  # 3.0 and 2.5


def test_truncated_is_token_caps_each_weight():
    fix = corrected("truncated_is_token", is_cap=2.0)
    assert_weights(fix, [[0.5, 1.0, 2.0, 0.0], [2.0, 0.25, 0.0, 0.0], [0.0] * 4])
    assert fix.metrics["is_capped_frac"] == pytest.approx(2 / 5)


def test_truncated_is_sequence_caps_the_product_of_the_sequences_weights():
    # products over trained tokens: 0.5 x 1 x 3 = 1.5; 2.5 x 0.25 = 0.625
    fix = corrected("truncated_is_sequence", is_cap=2.0)
    assert_weights(fix, [[1.5, 1.5, 1.5, 0.0], [0.625, 0.625, 0.0, 0.0], [0.0] * 4])
    assert fix.metrics["is_capped_frac"] == 0.0
    assert fix.metrics["is_weight_mean"] == pytest.approx((3 * 1.5 + 2 * 0.625) / 5)
    assert fix.metrics["is_weight_max"] == pytest.approx(1.5)
    fix = corrected("truncated_is_sequence", is_cap=1.0)
    assert_weights(fix, [[1.0, 1.0, 1.0, 0.0], [0.625, 0.625, 0.0, 0.0], [0.0] * 4])
    assert fix.metrics["is_capped_frac"] == pytest.approx(3 / 5)  # row 0's three tokens


def test_masked_is_token_keeps_weights_inside_the_band():
    fix = corrected("masked_is_token", is_mask_low=0.4, is_mask_high=2.0)
    # 0.5 and 1 are inside [0.4, 2]; 3.0, 2.5 and 0.25 are out
    assert_weights(fix, [[0.5, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0] * 4])
    assert fix.metrics["is_masked_frac"] == pytest.approx(3 / 5)


def test_masked_is_sequence_uses_the_geometric_mean():
    g0, g1 = 1.5 ** (1 / 3), 0.625**0.5  # 1.145, 0.791 (the products: 1.5, 0.625)
    fix = corrected("masked_is_sequence", is_mask_low=0.5, is_mask_high=2.0)
    assert_weights(fix, [[g0, g0, g0, 0.0], [g1, g1, 0.0, 0.0], [0.0] * 4])
    assert fix.metrics["is_masked_frac"] == 0.0
    assert fix.metrics["is_weight_mean"] == pytest.approx((3 * g0 + 2 * g1) / 5)
    fix = corrected("masked_is_sequence", is_mask_low=0.8, is_mask_high=2.0)
    assert_weights(fix, [[g0, g0, g0, 0.0], [0.0] * 4, [0.0] * 4])
    assert fix.metrics["is_masked_frac"] == pytest.approx(2 / 5)
    # a band that tells the two apart: row 0's product 1.5 is inside [1.2, 2], its
    # geometric mean 1.145 is not
    fix = corrected("masked_is_sequence", is_mask_low=1.2, is_mask_high=2.0)
    assert fix.metrics["is_masked_frac"] == 1.0


def test_log_weights_are_clamped_and_an_empty_mask_gives_neutral_metrics():
    behaviour = torch.tensor([[-40.0, -1.0]], dtype=F64)
    proximal = torch.tensor([[-1.0, -1.0]], dtype=F64)  # log weight 39 -> 20
    spec = AlgorithmSpec(off_policy_correction="truncated_is_token", is_cap=1e12)
    fix = correct(behaviour, proximal, torch.ones(1, 2), spec)
    assert fix.metrics["is_weight_max"] == pytest.approx(math.exp(MAX_LOG_WEIGHT))
    assert torch.isfinite(fix.weights).all()
    spec = AlgorithmSpec(off_policy_correction="decoupled_ppo")
    fix = correct(behaviour, proximal, torch.zeros(1, 2), spec)
    assert fix.metrics == {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_masked_frac": 0.0}
    assert torch.equal(fix.weights, torch.zeros(1, 2, dtype=F64))
