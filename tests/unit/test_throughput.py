"""A step's speed metrics: tokens per second, the MFU estimate (its FLOPs by the formula,
the peak from the config or the GPU's name, none on a CPU), and the response-length
percentiles and entropy every step reports."""

from __future__ import annotations

import math

import pytest
import torch

from streamrft.consumers.throughput import peak_tflops, step_flops, throughput_metrics
from streamrft.consumers.train_engine import TorchTrainEngine
from tests.helpers.groups import make_group
from tests.helpers.learning import learning_config

pytestmark = pytest.mark.unit


def test_the_flops_of_a_step_by_hand():
    # 1,000 parameters, 50 tokens, 2 epochs of forward + backward, a reference forward
    assert step_flops(1_000, 50, epochs=2, frozen_passes=1) == 1_000 * 50 * (12 + 2)


def test_the_metrics_of_a_step_by_hand():
    got = throughput_metrics(1_000, 0.5, flops=4e12, peak=10.0, peak_bytes=3 * 2**30)
    assert got == {"train/tokens_per_s": 2_000.0, "train/mfu": 0.8, "train/peak_memory_gb": 3.0}
    assert throughput_metrics(1_000, 0.5, 4e12, None, None) == {"train/tokens_per_s": 2_000.0}


def test_no_peak_on_a_cpu_unless_configured():
    assert peak_tflops(torch.device("cpu"), 0.0) is None
    assert peak_tflops(torch.device("cpu"), 123.0) == 123.0


def _groups() -> list:
    return [make_group("r", f"t{i}", 0, 4, rewards=[0.0, 1.0, 1.0, 0.0]) for i in range(2)]


def test_the_engine_reports_its_speed_and_no_mfu_on_a_cpu():
    engine = TorchTrainEngine(learning_config({"type": "grpo"}))
    engine.prepare()
    metrics = engine.train_step(_groups(), version=0)
    assert metrics["train/tokens_per_s"] > 0
    assert "train/mfu" not in metrics and "train/peak_memory_gb" not in metrics
    # the default groups: 8 rows of 2 response tokens
    assert metrics["train/response_length_p50"] == metrics["train/response_length_max"] == 2.0
    assert 0 < metrics["train/entropy"] < math.log(len(engine.tokenizer))


def test_the_mfu_is_the_steps_flops_over_its_time_and_the_configured_peak():
    cfg = learning_config({"type": "grpo", "kl_loss_coef": 0.1}, trainer={"peak_tflops": 2.0})
    engine = TorchTrainEngine(cfg)
    engine.prepare()
    groups = _groups()
    metrics = engine.train_step(groups, version=0)
    tokens = sum(e.num_tokens for g in groups for e in g.experiences)
    seconds = tokens / metrics["train/tokens_per_s"]
    params = sum(p.numel() for p in engine.model.parameters())
    # ppo_epochs 2 (the learning config), the reference model's forward pass
    flops = step_flops(params, tokens, epochs=2, frozen_passes=1)
    assert metrics["train/mfu"] == pytest.approx(flops / seconds / 2e12, rel=1e-9)
