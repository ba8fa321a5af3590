"""One GPU box: the memory shares of vLLM explorers and the trainer, and the start order
(``app/placement.py``), checked by configuration on any machine."""

from __future__ import annotations

import pytest
import torch

from streamrft.app.placement import check_gpu_shares, start_order, vllm_shares_gpu
from streamrft.infra.config import from_dict
from streamrft.schemas.errors import ConfigError

pytestmark = pytest.mark.unit


def config(device="cuda", engine="vllm", count=1, util=0.4, fraction=0.5, order="auto"):
    return from_dict(
        {
            "run": {"start_order": order},
            "taskset": {"path": "tasks.jsonl"},
            "model": {"device": device},
            "explorer": {"engine": engine, "count": count, "gpu_memory_utilization": util},
            "trainer": {"gpu_memory_fraction": fraction},
        }
    )


def test_vllm_on_the_trainers_gpu_starts_first_and_must_fit():
    cfg = config()
    assert vllm_shares_gpu(cfg)
    assert start_order(cfg) == "explorers_first"
    check_gpu_shares(cfg)  # 0.4 + 0.5 fits
    check_gpu_shares(config(count=2, util=0.3, fraction=0.35))  # 0.95 exactly


@pytest.mark.parametrize("device", ["cuda:0", "cuda"])
def test_every_gpu_device_counts_as_shared(device):
    assert start_order(config(device=device)) == "explorers_first"


def test_auto_counts_as_shared_only_where_torch_sees_a_gpu():
    cfg = config(device="auto", fraction=0.0)
    assert vllm_shares_gpu(cfg) == torch.cuda.is_available()
    if not torch.cuda.is_available():
        check_gpu_shares(cfg)  # vLLM on the CPU: no GPU shares to check


def test_shares_that_do_not_fit_name_the_fields():
    with pytest.raises(ConfigError, match=r"explorer.gpu_memory_utilization: 2 explorer\(s\)"):
        check_gpu_shares(config(count=2, util=0.4, fraction=0.3))  # 1.1
    with pytest.raises(ConfigError, match=r"trainer.gpu_memory_fraction: required"):
        check_gpu_shares(config(fraction=0.0))


@pytest.mark.parametrize(
    ("device", "engine"), [("cpu", "vllm"), ("cuda", "transformers"), ("cpu", "transformers")]
)
def test_without_vllm_on_a_gpu_nothing_is_shared(device, engine):
    cfg = config(device=device, engine=engine, count=4, util=0.9, fraction=0.0)
    assert not vllm_shares_gpu(cfg)
    assert start_order(cfg) == "trainer_first"
    check_gpu_shares(cfg)  # no rule applies


def test_the_order_can_be_forced_either_way():
    assert start_order(config(device="cpu", order="explorers_first")) == "explorers_first"
    assert start_order(config(order="trainer_first")) == "trainer_first"


def test_bad_values_are_refused_by_the_config():
    with pytest.raises(ConfigError, match=r"explorer\.gpu_memory_utilization"):
        config(util=1.5)
    with pytest.raises(ConfigError, match=r"run\.start_order"):
        config(order="sideways")
