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
    with pytest.raises(ConfigError, match=r"explorer.gpu_memory_utilization: 2 vLLM engine\(s\)"):
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


def placed(**sections):
    return from_dict({"taskset": {"path": "tasks.jsonl"}, **sections})


def test_each_role_takes_its_own_device_else_the_models():
    from streamrft.app.placement import placement
    from streamrft.infra.config import for_role, role_device

    cfg = placed(
        model={"device": "cuda"},
        explorer={"count": 5, "devices": ["cuda:0", "cuda:1", "cpu"]},
        trainer={"device": "cuda:2"},
    )
    assert role_device(cfg, "trainer") == ("cuda:2", "trainer.device")
    assert [role_device(cfg, "explorer", i) for i in (0, 1, 2, 3)] == [
        ("cuda:0", "explorer.devices[0]"),
        ("cuda:1", "explorer.devices[1]"),
        ("cpu", "explorer.devices[2]"),
        ("cuda:0", "explorer.devices[0]"),
    ]
    assert placement(cfg) == [
        ("trainer", "cuda:2", "trainer.device"),
        ("explorer 0,3", "cuda:0", "explorer.devices[0]"),
        ("explorer 1,4", "cuda:1", "explorer.devices[1]"),
        ("explorer 2", "cpu", "explorer.devices[2]"),
    ]
    assert for_role(cfg, "explorer", 1).model.device == "cuda:1"
    assert for_role(cfg, "trainer").model.device == "cuda:2"
    plain = placed(explorer={"device": "cuda:1"})
    assert role_device(plain, "explorer", 7) == ("cuda:1", "explorer.device")
    assert role_device(plain, "trainer") == ("cpu", "model.device")
    assert for_role(plain, "trainer") is plain


def test_vllm_shares_only_count_explorers_on_the_trainers_gpu():
    two_gpus = placed(
        model={"device": "cuda"},
        explorer={"engine": "vllm", "count": 2, "devices": ["cuda:1", "cuda:0"]},
        trainer={"device": "cuda:0", "gpu_memory_fraction": 0.5},
    )
    assert vllm_shares_gpu(two_gpus) and start_order(two_gpus) == "explorers_first"
    # explorer 1 on cuda:0 (= "cuda", the trainer's): 1 x 0.9 + 0.5 does not fit
    with pytest.raises(ConfigError, match=r"1 vLLM engine\(s\) .* x 0.9 \+ .* 'cuda:0'"):
        check_gpu_shares(two_gpus)
    apart = placed(explorer={"engine": "vllm", "device": "cuda:1"}, trainer={"device": "cuda:0"})
    assert not vllm_shares_gpu(apart) and start_order(apart) == "trainer_first"
    check_gpu_shares(apart)  # nothing shared: no trainer share needed


def test_wrong_placements_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"explorer.device or explorer.devices, not both"):
        placed(explorer={"device": "cpu", "devices": ["cpu"]})
    with pytest.raises(ConfigError, match=r"trainer.device: 'cuda:1' names one device"):
        placed(trainer={"device": "cuda:1", "nproc": 2})
    with pytest.raises(ConfigError, match=r"explorer.devices\[1\]: Expected `str` matching"):
        placed(explorer={"devices": ["cpu", "gpu0"]})


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="needs a machine with at most 3 GPUs")
def test_a_device_that_is_not_there_is_a_start_up_error_naming_its_field(capsys, monkeypatch):
    from streamrft.app.cli import main
    from tests.helpers.paths import EXAMPLE

    argv = ["explore", str(EXAMPLE), "--run-id", "r", "--index", "1"]
    setting = ["-o", "explorer.devices=[cpu, 'cuda:3']"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # so that what the code sets is undone
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert main([*argv, *setting]) != 0
    assert "explorer.devices[1]: 'cuda:3' but" in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # the process may see two GPUs
    assert main([*argv, *setting]) != 0
    assert "'cuda:3' but only 2 GPU(s) are visible (CUDA_VISIBLE_DEVICES='4,5')" in (
        capsys.readouterr().err
    )


def test_a_process_on_one_gpu_is_shown_only_that_gpu(monkeypatch):
    """``cuda:N`` becomes the only GPU the process sees (counted among those it may see),
    called ``cuda`` inside it, so vLLM and the broadcast's checks see the named GPU."""
    import os

    from streamrft.app import cli

    checked = []
    monkeypatch.setattr(
        "streamrft.infra.modeling.resolve_device", lambda spec, field: checked.append(spec)
    )
    cfg = placed(
        explorer={"count": 2, "devices": ["cuda:1", "cuda:0"]}, trainer={"device": "cuda:2"}
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")  # undone after the test, as set here
    assert cli._placed(cfg, "explorer", 0).model.device == "cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cli._placed(cfg, "trainer").model.device == "cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cpu = placed(explorer={"device": "cpu"})
    assert cli._placed(cpu, "explorer").model.device == "cpu"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and checked == ["cuda", "cuda"]


def test_trainer_ranks_on_listed_gpus_see_only_theirs(monkeypatch):
    from streamrft.app.launch import rank_env
    from streamrft.app.placement import placement

    cfg = placed(
        model={"device": "cuda"},
        explorer={"count": 6, "devices": [f"cuda:{i}" for i in range(6)]},
        trainer={"nproc": 2, "devices": ["cuda:6", "cuda:7"]},
    )
    assert placement(cfg)[0] == ("trainer ranks 0-1", "cuda:6,cuda:7", "trainer.devices")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = rank_env(1, 2, 29500, [6, 7])
    assert (env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"]) == ("6,7", "1")  # cuda:1 is GPU 7
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,9,10,11,12,13")
    # indexes of what the launcher itself sees
    assert rank_env(0, 2, 29500, [6, 7])["CUDA_VISIBLE_DEVICES"] == "12,13"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "CUDA_VISIBLE_DEVICES" not in rank_env(0, 2, 29500, None)
    for bad in (["cuda:6"], ["cuda:6", "cuda:6"], ["cuda:6", "cpu"]):
        with pytest.raises(ConfigError, match=r"trainer.devices: .* one per rank"):
            placed(trainer={"nproc": 2, "devices": bad})
    with pytest.raises(ConfigError, match=r"one process: trainer.device"):
        placed(trainer={"devices": ["cuda:3"]})
    with pytest.raises(ConfigError, match=r"model.device: 'cuda:0' names one device"):
        placed(model={"device": "cuda:0"}, trainer={"nproc": 2})
    from streamrft.app.plan import make_plan

    plan = make_plan(cfg, 16, None)
    assert [d for n, d, _ in plan.processes if n.startswith("trainer")] == ["cuda:6", "cuda:7"]


def test_evaluators_are_placed_and_their_vllm_shares_counted():
    """An evaluator sits on ``eval.device``, else on the first explorer's device; it samples
    with ``eval.engine`` (else the explorers'), and a vLLM one takes a share of its GPU like
    an explorer: beside the trainer, and beside other vLLM engines on another GPU."""
    from streamrft.app.placement import placement
    from streamrft.infra.config import for_role, role_device

    cfg = placed(
        explorer={"engine": "vllm", "devices": ["cuda:0", "cuda:1"], "count": 2},
        trainer={"device": "cuda:2"},
        eval={"count": 2},
    )
    assert role_device(cfg, "evaluator") == ("cuda:0", "explorer.devices[0]")
    assert placement(cfg)[-1] == ("evaluator 0,1", "cuda:0", "explorer.devices[0]")
    # explorer 0 and two evaluators on cuda:0: 3 x 0.9
    with pytest.raises(ConfigError, match=r"3 vLLM engines .* on cuda:0 x 0.9 = 2.70"):
        check_gpu_shares(cfg)
    light = placed(
        explorer={"engine": "vllm", "device": "cuda:0", "gpu_memory_utilization": 0.4},
        trainer={"device": "cuda:1"},
        eval={"count": 1},
    )
    check_gpu_shares(light)  # 2 x 0.4 on cuda:0
    beside = placed(
        explorer={"engine": "vllm", "device": "cuda:0"},
        trainer={"device": "cuda:1", "gpu_memory_fraction": 0.5},
        eval={"count": 1, "device": "cuda:1"},
    )
    assert vllm_shares_gpu(beside) and start_order(beside) == "explorers_first"
    with pytest.raises(ConfigError, match=r"1 vLLM engine\(s\) .* x 0.9 \+ .* 'cuda:1'"):
        check_gpu_shares(beside)
    hf = placed(
        explorer={"engine": "vllm", "device": "cuda:0"},
        trainer={"device": "cuda:1"},
        eval={"count": 1, "device": "cuda:1", "engine": "transformers"},
    )
    assert not vllm_shares_gpu(hf) and start_order(hf) == "trainer_first"
    check_gpu_shares(hf)
    evaluator = for_role(hf, "evaluator")
    assert (evaluator.model.device, evaluator.explorer.engine) == ("cuda:1", "transformers")
    assert for_role(hf, "explorer").explorer.engine == "vllm"
    assert role_device(hf, "evaluator") == ("cuda:1", "eval.device")


def test_a_tensor_parallel_vllm_engine_spans_gpus_from_its_device(monkeypatch):
    """``explorer.tensor_parallel_size`` N: a vLLM explorer (or evaluator) on ``cuda:k`` is
    shown GPUs k to k+N-1 and takes vLLM's share on each; the shares of engines whose spans
    meet are added up; any other engine with N above 1 is refused."""
    import os

    from streamrft.app import cli
    from streamrft.app.placement import engine_gpus, span, vllm_devices

    monkeypatch.setattr("streamrft.infra.modeling.resolve_device", lambda spec, field: None)
    cfg = placed(
        explorer={
            "engine": "vllm",
            "count": 2,
            "devices": ["cuda:0", "cuda:2"],
            "tensor_parallel_size": 2,
            "gpu_memory_utilization": 0.8,
        },
        trainer={"device": "cuda:4"},
        eval={"count": 1, "engine": "transformers", "device": "cuda:4"},
    )
    assert engine_gpus(cfg, "explorer") == 2 and engine_gpus(cfg, "evaluator") == 1
    assert engine_gpus(cfg, "trainer") == 1
    assert span("cuda:2", 2) == ["cuda:2", "cuda:3"] and span("cuda", 3)[-1] == "cuda:2"
    assert span("cpu", 2) == ["cpu"]
    assert vllm_devices(cfg) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    check_gpu_shares(cfg)  # one engine on each GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12,13,14")
    assert cli._placed(cfg, "explorer", 1).model.device == "cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "12,13"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12,13,14")
    cli._placed(cfg, "evaluator")  # the transformers evaluator: one GPU
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "14"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12")  # cuda:2 and cuda:3: one missing
    with pytest.raises(ConfigError, match=r"explorer.devices\[1\]: 'cuda:3' but only 3 GPU"):
        cli._placed(cfg, "explorer", 1)
    overlap = placed(
        explorer={
            "engine": "vllm",
            "count": 2,
            "devices": ["cuda:0", "cuda:1"],
            "tensor_parallel_size": 2,
            "gpu_memory_utilization": 0.8,
        },
        trainer={"device": "cuda:4"},
    )
    with pytest.raises(ConfigError, match=r"2 vLLM engines .* on cuda:1 x 0.8"):
        check_gpu_shares(overlap)
    with pytest.raises(ConfigError, match=r"explorer.tensor_parallel_size: 2, but only the vllm"):
        placed(explorer={"tensor_parallel_size": 2})
