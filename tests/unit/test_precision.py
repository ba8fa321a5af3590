"""Device and precision on the CPU: token-budget micro-batches, gradient checkpointing,
bf16/fp16 mixed precision with float32 master weights, and versions sent in the explorers'
dtype (``model.device``, ``model.dtype``, ``trainer.max_tokens_per_micro_batch``,
``trainer.gradient_checkpointing``)."""

from __future__ import annotations

import copy

import pytest
import torch

from streamrft.consumers.algorithms import LOSS_AGG, policy_step, resolve_algorithm
from streamrft.consumers.algorithms.step import BatchShare
from streamrft.consumers.batching import collate, micro_slices, response_logprobs
from streamrft.consumers.precision import Precision
from streamrft.consumers.train_engine import enable_checkpointing
from streamrft.infra.config import AlgorithmConfig, Config, ModelConfig, TrainerConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model, load_policy
from streamrft.schemas.errors import ConfigError
from streamrft.sync.payload import ModelWeights
from streamrft.sync.weights import apply_state_dict, tensors_dtype
from tests.helpers.groups import make_group

pytestmark = [pytest.mark.unit, pytest.mark.numeric]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def fresh_model(tokenizer):
    return build_tiny_model(ModelConfig(seed=3, max_positions=64), tokenizer).eval()


def uneven_groups(n_groups: int = 6, n: int = 4, masked: bool = False):
    """Groups whose prompts (3..8 tokens) and responses (1..9 tokens) differ in length;
    ``masked``: some response tokens are not trained, and two rollouts have none."""
    groups = []
    for g in range(n_groups):
        prompt = [1, *range(5, 5 + 2 + g)]
        tokens, logps, masks = [], [], []
        for i in range(n):
            resp = [10 + (g + i) % 7 for _ in range(1 + (g * 3 + i * 2) % 9)] + [2]
            tokens.append(prompt + resp)
            logps.append([-1.0 - 0.1 * j for j in range(len(resp))])
            mask = [int(not masked or (g + i + j) % 3 > 0) for j in range(len(resp))]
            masks.append([0] * len(resp) if masked and (g, i) in ((1, 2), (4, 0)) else mask)
        rewards = [float((g + i) % 3 == 0) for i in range(n)]
        groups.append(
            make_group(
                "run",
                f"t{g}",
                0,
                n,
                rewards,
                tokens=tokens,
                prompt_length=len(prompt),
                logprobs=logps,
                masks=masks,
            )
        )
    return groups


def step(
    tokenizer,
    groups,
    cfg,
    precision=None,
    checkpointing=False,
    adam=False,
    ref=None,
    algorithm=None,
    share=None,
):
    """One policy step on a fresh model; SGD by default, so weights differ exactly as the
    gradients do (Adam's normalisation would magnify rounding in near-zero gradients);
    ``ref``: a reference model (for a KL term); ``algorithm``: the ``algorithm`` section
    (None: the default grpo); ``share``: how micro-batches are weighed (None: the
    trainer's own)."""
    algo = resolve_algorithm(Config(trainer=cfg, algorithm=algorithm or AlgorithmConfig()))
    model = fresh_model(tokenizer)
    if checkpointing:
        enable_checkpointing(model)
    params = model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2) if adam else torch.optim.SGD(params, lr=1.0)
    kwargs = {"precision": precision} if precision else {}
    stats = policy_step(
        model, opt, groups, cfg, algo, tokenizer.pad_token_id, 1.0, ref, share=share, **kwargs
    )
    return stats, model, opt


@torch.no_grad()
def max_param_diff(a, b) -> float:
    other = dict(b.named_parameters())
    return max(float((p - other[n]).abs().max()) for n, p in a.named_parameters())


@torch.no_grad()
def update(model, start) -> torch.Tensor:
    """All parameters' change from ``start``, flattened."""
    other = dict(start.named_parameters())
    return torch.cat([(p - other[n]).flatten() for n, p in model.named_parameters()])


# -- micro-batches by token budget -----------------------------------------------------------


def test_micro_slices_pack_rows_within_the_token_budget():
    p = [3, 3, 5, 2, 9, 1]
    r = [2, 4, 1, 1, 30, 2]
    slices = micro_slices(p, r, 0, 16)
    assert slices == [(0, 2), (2, 4), (4, 5), (5, 6)]
    for lo, hi in slices:
        width = max(p[lo:hi]) + max(r[lo:hi])
        assert (hi - lo) * width <= 16 or hi - lo == 1  # the 39-token row goes alone
    assert micro_slices(p, r, 0, 0) == [(0, 6)]
    assert micro_slices(p, r, 4, 0) == [(0, 4), (4, 6)]
    assert micro_slices(p, r, 1, 1000) == [(i, i + 1) for i in range(6)]
    assert micro_slices([], [], 0, 8) == []


def test_a_micro_batch_is_padded_to_its_own_widths_and_gives_the_same_logprobs(tokenizer):
    model = fresh_model(tokenizer)
    batch = collate([e for g in uneven_groups() for e in g.experiences], tokenizer.pad_token_id)
    full = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width)
    part = batch.rows(0, 4)  # the first group: shortest prompts and responses
    assert part.input_ids.shape[1] < batch.input_ids.shape[1]
    assert part.prompt_width == max(part.prompt_lengths())
    assert part.input_ids.shape[1] == part.prompt_width + max(part.response_lengths())
    logp = response_logprobs(model, part.input_ids, part.attention_mask, part.prompt_width)
    width = logp.shape[1]
    mask = part.response_mask.bool()
    assert torch.allclose(logp[mask], full[:4, :width][mask], atol=1e-5)


SPLITS = {
    "tokens_40": {"max_tokens_per_micro_batch": 40},
    "tokens_20": {"max_tokens_per_micro_batch": 20},
    "rows_4": {"micro_batch_size": 4},
    "rows_5": {"micro_batch_size": 5},
    "rows_7_tokens_60": {"micro_batch_size": 7, "max_tokens_per_micro_batch": 60},
}
"""Micro-batchings of the 24 rows of :func:`uneven_groups`: by a token budget (very uneven
micro-batches), by rows, both."""

STAT_REL = 2e-5
"""Relative tolerance on a step's loss, KL and grad norm, micro-batched against whole.
The loss is float32 whatever the model (``response_logprobs`` casts the logits), and a
micro-batched step sums the same tokens and parameters' gradients in another order, so
the two agree only to float32 rounding over the sum, and that rounding depends on the
CPU's kernels: measured up to 4.6e-7 on AMD EPYC, 1.1e-6 on an Intel Xeon, 1.9e-6 with
MKL's portable code path (``MKL_CBWR=COMPATIBLE``) on EPYC. A wrong micro-batch weighting
shifts them by 1.6e-2 or more (:func:`test_a_wrong_micro_batch_weighting_is_far_outside_the_tolerance`),
800 times this tolerance."""

PARAM_ABS = 3e-5
"""Largest difference of any parameter after one SGD step (lr 1) micro-batched against
whole: measured up to 2.4e-6 (``MKL_CBWR=COMPATIBLE`` on EPYC, seq-mean-token-sum, whose
updates are the largest); a wrong weighting moves some parameter by 2e-3 or more."""


def micro_batched_against_whole(tokenizer, mode, split, share=None):
    """The step's statistics and model, whole and micro-batched by ``split`` (weighed by
    ``share``; None: the trainer's own): some tokens and two whole rollouts are not
    trained, a KL term is on, two epochs."""
    groups = uneven_groups(masked=True)
    base = {"grad_clip": 0.0, "ppo_epochs": 2}
    algorithm = AlgorithmConfig(loss_agg_mode=mode, kl_loss_coef=0.1)
    ref = fresh_model(tokenizer)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)  # a reference that differs from the policy
    whole, model_a, _ = step(tokenizer, groups, TrainerConfig(**base), ref=ref, algorithm=algorithm)
    split_stats, model_b, _ = step(
        tokenizer,
        groups,
        TrainerConfig(**base, **SPLITS[split]),
        ref=ref,
        algorithm=algorithm,
        share=share,
    )
    assert whole["train/micro_batches"] == 1
    assert split_stats["train/micro_batches"] >= 4
    return whole, split_stats, model_a, model_b


STAT_KEYS = ("train/loss", "train/kl_ref", "train/grad_norm")


@pytest.mark.parametrize("mode", list(LOSS_AGG))
@pytest.mark.parametrize("split", list(SPLITS))
def test_a_micro_batched_step_equals_the_whole_batch_step(tokenizer, mode, split):
    """Any micro-batching (a memory setting) gives the whole batch's loss, gradient and
    update, for every ``algorithm.loss_agg_mode``, up to float32 rounding (:data:`STAT_REL`,
    :data:`PARAM_ABS`): each micro-batch is weighed by its share of what the mode divides
    by."""
    whole, split_stats, model_a, model_b = micro_batched_against_whole(tokenizer, mode, split)
    for key in STAT_KEYS:
        assert split_stats[key] == pytest.approx(whole[key], rel=STAT_REL), key
    assert whole["train/kl_ref"] > 1e-4
    assert max_param_diff(model_a, model_b) < PARAM_ABS
    assert max_param_diff(model_a, fresh_model(tokenizer)) > 1e-3  # it did train


class RowShare(BatchShare):
    """The common defect: every micro-batch weighed by its share of the batch's rows,
    whatever the mode divides by (what a plain mean of micro-batch losses does)."""

    def rows(self, batch, lo, hi):
        return lo, hi, float(hi - lo), float(batch.response_mask.shape[0])


@pytest.mark.parametrize("mode", list(LOSS_AGG))
@pytest.mark.parametrize("split", ["tokens_40", "rows_4"])
def test_a_wrong_micro_batch_weighting_is_far_outside_the_tolerance(tokenizer, mode, split):
    """The tolerances above leave room for float32 rounding only: weighing micro-batches
    by rows instead of the mode's normaliser misses the whole step by at least 100 times
    :data:`STAT_REL` and 30 times :data:`PARAM_ABS` (measured: 1.6e-2 relative and 2e-3
    on a parameter at the least, seq-mean-token-sum-norm by rows of 4)."""
    share = RowShare(mode)
    whole, split_stats, model_a, model_b = micro_batched_against_whole(
        tokenizer, mode, split, share
    )
    shift = max(abs(split_stats[k] - whole[k]) / abs(whole[k]) for k in STAT_KEYS)
    assert shift > 100 * STAT_REL
    assert max_param_diff(model_a, model_b) > 30 * PARAM_ABS


def test_gradient_checkpointing_gives_the_same_step(tokenizer):
    groups = uneven_groups()
    cfg = TrainerConfig()
    plain, model_a, _ = step(tokenizer, groups, cfg)
    ckpt, model_b, _ = step(tokenizer, groups, cfg, checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model_b.modules())
    assert ckpt["train/loss"] == pytest.approx(plain["train/loss"], rel=STAT_REL)
    assert max_param_diff(model_a, model_b) < PARAM_ABS
    assert max_param_diff(model_a, fresh_model(tokenizer)) > 1e-4  # it did train


# -- mixed precision -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_keeps_float32_master_weights_and_tracks_the_float32_step(tokenizer, dtype):
    groups = uneven_groups()
    cfg = TrainerConfig(grad_clip=0.0)
    ref, ref_model, _ = step(tokenizer, groups, cfg)
    mixed, model, _ = step(tokenizer, groups, cfg, Precision.of(torch.device("cpu"), dtype))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.isfinite(torch.tensor(mixed["train/loss"]))
    # the same update as float32, up to the compute dtype's rounding
    start = fresh_model(tokenizer)
    ref_update, mixed_update = update(ref_model, start), update(model, start)
    assert float(ref_update.norm()) > 1e-2
    cosine = torch.nn.functional.cosine_similarity(ref_update, mixed_update, dim=0)
    assert float(cosine) > 0.99
    assert float(mixed_update.norm() / ref_update.norm()) == pytest.approx(1.0, abs=0.05)
    assert mixed["train/loss"] == pytest.approx(ref["train/loss"], abs=0.02)
    # AdamW's moments stay float32 too
    precision = Precision.of(torch.device("cpu"), dtype)
    _, _, opt = step(tokenizer, groups, cfg, precision, adam=True)
    moments = [st["exp_avg"] for st in opt.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    if dtype == torch.float16:
        assert precision.scaler is not None and precision.scaler.get_scale() > 0


def test_the_autocast_forward_really_runs_in_the_compute_dtype(tokenizer):
    model = fresh_model(tokenizer)
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, args, out: seen.append(out.dtype)
    )
    ids = torch.tensor([[1, 5, 6, 7]])
    with Precision.of(torch.device("cpu"), torch.bfloat16).autocast():
        model(input_ids=ids)
    with Precision().autocast():
        model(input_ids=ids)
    hook.remove()
    assert seen == [torch.bfloat16, torch.float32]


# -- devices, loading and sending ------------------------------------------------------------


def test_model_device_and_dtype_are_honoured_when_loading():
    model, _ = load_policy(ModelConfig(dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    master, _ = load_policy(ModelConfig(dtype="bfloat16"), dtype=torch.float32)
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    auto, _ = load_policy(ModelConfig(device="auto"))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(auto.parameters()).device.type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_a_missing_gpu_is_a_clear_error_not_a_silent_cpu_run():
    with pytest.raises(ConfigError, match=r"model.device: 'cuda:1' but torch sees no GPU"):
        load_policy(ModelConfig(device="cuda:1"))


def test_versions_go_out_in_the_explorers_dtype(tokenizer):
    master = fresh_model(tokenizer)
    payload = ModelWeights(master, lora=False, dtype=torch.bfloat16).payload(1, 1)
    assert tensors_dtype(payload.tensors) == "bfloat16"
    assert tensors_dtype(ModelWeights(master, lora=False).payload(1, 1).tensors) == "float32"
    explorer = copy.deepcopy(master).to(torch.bfloat16)
    with torch.no_grad():
        for p in explorer.parameters():
            p.zero_()
    apply_state_dict(explorer, payload.tensors)
    for name, p in explorer.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, dict(master.named_parameters())[name].to(torch.bfloat16)), name
