"""The ``fsdp2`` engine on 2 gloo ranks takes the single-process step: same loss, same
weights after it (within 1e-5), which are those of the whole batch in one piece (no
micro-batches), and checkpoints either engine resumes from.

Real processes (``app.launch``), no broker needed: the ranks run
``tests/helpers/fsdp_rank.py`` on the batch of :func:`~tests.helpers.fsdp_rank.batch`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from streamrft.app.launch import launch
from streamrft.consumers.algorithms import resolve_algorithm
from streamrft.consumers.checkpoint_folders import latest_checkpoint
from streamrft.consumers.train_engine import TorchTrainEngine
from streamrft.infra.config import Config
from streamrft.sync.weights import unique_state_dict
from tests.helpers.fsdp_rank import CASES, batch, case_config
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Every case's step on 2 ranks; the folder of their results."""
    out = tmp_path_factory.mktemp("fsdp")
    argv = [sys.executable, "-m", "tests.helpers.fsdp_rank", str(out)]
    assert launch(argv, 2, handle_signals=False, cwd=str(ROOT)) == 0
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _one_piece(cfg: Config) -> Config:
    """``cfg`` with the whole batch in one micro-batch."""
    trainer = msgspec.structs.replace(cfg.trainer, micro_batch_size=0, max_tokens_per_micro_batch=0)
    return msgspec.structs.replace(cfg, trainer=trainer)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_step_equals_the_single_process_step(case, two_ranks, tmp_path):
    single = TorchTrainEngine(case_config(case, tmp_path, 1))
    single.prepare()
    before = {k: v.clone() for k, v in unique_state_dict(single.model).items()}
    metrics = single.train_step(batch(), 0)
    after = unique_state_dict(single.model)

    sharded = json.loads((two_ranks / case / "metrics.json").read_text())
    weights = load_file(str(two_ranks / case / "weights.safetensors"))
    loss_diff = abs(sharded["train/loss"] - metrics["train/loss"])
    weight_diff = _max_diff(weights, after)
    print(f"{case}: |loss diff| {loss_diff:.2e}, max |weight diff| {weight_diff:.2e}")
    assert loss_diff <= TOLERANCE, (sharded["train/loss"], metrics["train/loss"])
    assert weight_diff <= TOLERANCE
    same = ["train/grad_norm", "train/reward_mean", "train/advantage_abs_mean", "train/lr"]
    if resolve_algorithm(case_config(case, tmp_path, 1)).spec.loss_agg_mode == "token-mean":
        same += ["train/clip_frac", "train/approx_kl_old"]  # token means, weighed alike
    for key in same:
        assert sharded[key] == pytest.approx(metrics[key], abs=TOLERANCE), key
    # the step did something, and the same in both: every trainable tensor moved, but
    # LoRA's A matrices (B starts at zero, so A's first gradient is zero)
    trainable = [n for n, p in single.model.named_parameters() if p.requires_grad]
    moved = [n for n in trainable if not torch.equal(before[n], after[n])]
    assert moved == [n for n in trainable if not torch.equal(before[n], weights[n])]
    assert moved == [n for n in trainable if "lora_A" not in n]
    # micro-batches and ranks cut the batch, not its step: the whole batch in one piece
    whole = TorchTrainEngine(_one_piece(case_config(case, tmp_path, 1)))
    whole.prepare()
    whole_metrics = whole.train_step(batch(), 0)
    assert whole_metrics["train/micro_batches"] == 1
    whole_diff = _max_diff(weights, unique_state_dict(whole.model))
    print(f"{case}: vs the whole batch in one piece, max |weight diff| {whole_diff:.2e}")
    assert sharded["train/loss"] == pytest.approx(whole_metrics["train/loss"], abs=TOLERANCE)
    assert whole_diff <= TOLERANCE


@pytest.mark.parametrize("case", list(CASES))
def test_the_torch_engine_resumes_from_a_two_rank_checkpoint(case, two_ranks, tmp_path):
    """The gathered checkpoint is the single-process format: weights and AdamW state load
    into the ``torch`` engine, and its next step equals one taken without the detour."""
    ckpt = latest_checkpoint(two_ranks / "runs" / f"fsdp-{case}" / "checkpoints")
    assert ckpt is not None
    resumed = TorchTrainEngine(case_config(case, tmp_path, 1))
    resumed.prepare()
    assert resumed.load(ckpt).step == 1
    straight = TorchTrainEngine(case_config(case, tmp_path, 1))
    straight.prepare()
    straight.train_step(batch(), 0)
    assert _max_diff(unique_state_dict(resumed.model), unique_state_dict(straight.model)) <= 1e-5
    resumed.train_step(batch(), 1)
    straight.train_step(batch(), 1)
    diff = _max_diff(unique_state_dict(resumed.model), unique_state_dict(straight.model))
    print(f"{case}: second step after the checkpoint, max |weight diff| {diff:.2e}")
    assert diff <= TOLERANCE
