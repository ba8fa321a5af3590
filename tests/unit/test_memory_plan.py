"""``streamrft plan``'s arithmetic: the model's size counted as torch counts it, each part
of a process's memory as the formulas in ``infra/memory_plan.py`` say, computed here by
hand, and the command's verdict."""

from __future__ import annotations

import json
from dataclasses import replace

import msgspec
import pytest

from streamrft.app.cli import main
from streamrft.app.plan import as_json, make_plan, model_shape, render, safetensors_params
from streamrft.infra.config import LoraConfig, ModelConfig, from_dict
from streamrft.infra.memory_plan import (
    GIB,
    ModelShape,
    Workload,
    explorer_estimate,
    llama_shape,
    lora_params,
    parse_size,
    trainer_estimate,
)
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model, save_policy
from streamrft.schemas.errors import ConfigError
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.unit

TINY = ModelConfig(hidden_size=48, intermediate_size=96, num_layers=3, num_heads=4)


def _tiny():
    tokenizer = build_char_tokenizer(TINY.charset)
    return build_tiny_model(TINY, tokenizer), tokenizer


def test_the_shape_counts_parameters_as_torch_does(tmp_path):
    model, tokenizer = _tiny()
    real = sum(p.numel() for p in model.parameters())
    assert model_shape(TINY).params == real
    assert model_shape(TINY).vocab == len(tokenizer)
    folder = save_policy(model, tokenizer, tmp_path / "m")
    assert safetensors_params(folder) == real  # tied embeddings are stored once
    from_folder = model_shape(ModelConfig(source="path", path=str(folder)))
    assert from_folder == model_shape(TINY)
    # grouped-query attention and an untied head, against torch's count
    from transformers import LlamaConfig, LlamaForCausalLM

    gqa = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    expected = sum(p.numel() for p in LlamaForCausalLM(gqa).parameters())
    assert llama_shape(100, 64, 160, 2, 8, 2, tied=False).params == expected
    # a head size that is not hidden / heads (as Qwen3 and Gemma have)
    wide = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    expected = sum(p.numel() for p in LlamaForCausalLM(wide).parameters())
    shape = llama_shape(100, 64, 160, 2, 8, 2, tied=True, head_dim=16)
    assert (shape.params, shape.query, shape.kv_width) == (expected, 128, 32)


def test_a_lora_adapter_counts_as_peft_makes_it():
    from streamrft.sync.lora import attach_lora

    model, _ = _tiny()
    lora = LoraConfig(enabled=True, rank=4)
    wrapped = attach_lora(model, lora)
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert lora_params(model_shape(TINY), 4, lora.target_modules) == trained
    with pytest.raises(ConfigError, match="not lm_head"):
        lora_params(model_shape(TINY), 4, ("q_proj", "lm_head"))


SHAPE = ModelShape(params=1000, layers=2, hidden=10, intermediate=20, kv_width=5, vocab=50)
WORK = Workload(
    dtype_bytes=2, trainable=1000, micro_batch_tokens=7, prompt_tokens=3, response_tokens=4,
    rows_sampled=6,
)  # fmt: skip


def test_a_trainer_rank_by_hand():
    est = trainer_estimate(SHAPE, WORK, checkpointing=False)
    assert est.parts == {"weights": 4000, "gradients": 4000, "optimizer": 8000}
    layer = 2 * 7 * (6 * 10 + 2 * 5 + 4 * 20)  # 2100
    logits = 7 * 50 * (2 + 4 + 4)  # 3500
    assert est.activations == 2 * layer + logits == 7700
    assert est.activations_checkpointed == layer + 2 * (2 * 7 * 10) + logits == 5880
    assert est.total == 16000 + 7700
    assert trainer_estimate(SHAPE, WORK, checkpointing=True).total == 16000 + 5880
    # two FSDP2 ranks halve the states, a reference copy in 2 bytes, LoRA's 40 trained
    two = trainer_estimate(SHAPE, replace(WORK, ranks=2, reference=True), False)
    assert two.parts == {"weights": 2000, "gradients": 2000, "optimizer": 4000, "reference": 1000}
    adapter = trainer_estimate(SHAPE, replace(WORK, trainable=40), False)
    assert adapter.parts == {"weights": 4000, "gradients": 160, "optimizer": 320}
    # PPO's critic: a whole model trained (16 bytes a parameter) and its layers' activations
    # again, no logits; with LoRA it is still all trained
    critic = trainer_estimate(SHAPE, replace(WORK, trainable=40, critic=True), False)
    assert critic.parts["critic"] == 16000 and critic.activations == 2 * 2 * 2100 + 3500
    # two ranks split each micro-batch: 4 tokens each (7 rounded up)
    halves = trainer_estimate(SHAPE, replace(WORK, ranks=2), False)
    assert halves.activations == 2 * (2 * 4 * 150) + 4 * 50 * 10


def test_an_explorer_by_hand():
    est = explorer_estimate(SHAPE, WORK)
    kv = 2 * 2 * 5 * 2 * 6 * (3 + 4)  # K and V, layers, width, bytes, rows, length
    assert est.parts == {"weights": 2000, "kv_cache": kv, "logits": 8 * 6 * 50}
    assert est.activations == 0 and est.total == 2000 + kv + 2400


def test_the_plan_of_a_config_places_and_sums_processes():
    cfg = from_dict(
        {
            "taskset": {"path": "x.jsonl"},
            "explorer": {"count": 2, "batch_size": 4, "repeat_times": 2, "max_new_tokens": 8},
            "trainer": {"batch_size": 4, "micro_batch_size": 2, "max_tokens_per_micro_batch": 0},
        }
    )
    plan = make_plan(cfg, prompt_tokens=24, device_bytes=GIB)
    assert [(n, d) for n, d, _ in plan.processes] == [
        ("trainer", "cpu"), ("explorer-0", "cpu"), ("explorer-1", "cpu")
    ]  # fmt: skip
    assert plan.work.micro_batch_tokens == 2 * (24 + 8) and plan.work.rows_sampled == 8
    assert plan.by_device() == {"cpu": sum(e.total for _, _, e in plan.processes)}
    assert plan.fits() is True
    assert make_plan(cfg, 24, 1000).fits() is False


@pytest.mark.parametrize(
    ("text", "size"),
    [("80GiB", 80 * GIB), ("80 GB", 80 * 10**9), ("81920MiB", 80 * GIB), ("1.5GiB", 3 * GIB // 2),
     ("4096", 4096)],
)  # fmt: skip
def test_sizes(text, size):
    assert parse_size(text) == size


def test_a_size_that_is_none_is_named():
    with pytest.raises(ConfigError, match="'80 apples' is not a size"):
        parse_size("80 apples")


def test_the_command_says_whether_it_fits(capsys):
    assert main(["plan", str(EXAMPLE), "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "trainer" in out and "explorer-0" in out and ": fits" in out
    assert main(["plan", str(EXAMPLE), "--device-memory", "1MiB", "--json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["device_memory"] == 1 << 20
    assert plan["devices"]["cpu"] == sum(p["total"] for p in plan["processes"])


def test_processes_are_summed_on_the_devices_their_roles_name():
    cfg = from_dict(
        {
            "taskset": {"path": "x.jsonl"},
            "model": {"device": "cuda:1"},
            "explorer": {"count": 3, "devices": ["cuda:1", "cuda:0"]},
            "trainer": {"device": "cuda:0"},
        }
    )
    plan = make_plan(cfg, 16, 80 * GIB)
    assert [d for _, d, _ in plan.processes] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    trainer, e0, e1, e2 = (est.total for _, _, est in plan.processes)
    assert plan.by_device() == {"cuda:0": trainer + e1, "cuda:1": e0 + e2}


def test_cuda_and_cuda_0_are_one_gpu_and_the_trainer_cap_counts():
    cfg = from_dict(
        {
            "taskset": {"path": "x.jsonl"},
            "model": {"device": "cuda"},
            "explorer": {"device": "cuda:0"},
            "trainer": {"gpu_memory_fraction": 0.5},
        }
    )
    plan = make_plan(cfg, 16, GIB)
    assert list(plan.by_device()) == ["cuda:0"]
    trainer = plan.processes[0][2].total
    assert plan.fits() is True
    assert make_plan(cfg, 16, int(trainer * 1.5)).fits() is False  # over half: its cap
    cpu = from_dict({"taskset": {"path": "x.jsonl"}, "trainer": {"nproc": 2}})
    assert [d for _, d, _ in make_plan(cpu, 16, None).processes][:2] == ["cpu", "cpu"]


def test_evaluators_and_tensor_parallel_engines_have_their_rows():
    """An evaluator is an explorer's estimate at its own rows and lengths (``eval.batch_size``
    sequences, or fewer eval tasks; ``eval.max_new_tokens``); a vLLM engine spanning N GPUs
    has a row with vLLM's share on each of them."""
    cfg = from_dict(
        {
            "taskset": {"path": "x.jsonl"},
            "explorer": {"count": 1, "batch_size": 4, "repeat_times": 2, "max_new_tokens": 8},
            "eval": {"count": 2, "max_tasks": 5, "max_new_tokens": 6},
        }
    )
    plan = make_plan(cfg, prompt_tokens=24, device_bytes=GIB)
    rows = {n: e for n, _, e in plan.processes}
    assert list(rows) == ["trainer", "explorer-0", "evaluator-0", "evaluator-1"]
    shape = plan.shape
    reading = replace(plan.work, rows_sampled=5, response_tokens=6)
    own = explorer_estimate(shape, reading, "evaluator")  # and its staging copy (float32)
    assert rows["evaluator-1"] == replace(own, parts={**own.parts, "staging": 4 * shape.params})
    kv = 2 * shape.layers * shape.kv_width * 4 * 5 * (24 + 6)  # float32, 5 rows, 30 tokens
    assert rows["evaluator-0"].parts["kv_cache"] == kv
    vllm = from_dict(
        {
            "taskset": {"path": "x.jsonl"},
            "model": {"device": "cuda"},
            "explorer": {
                "engine": "vllm",
                "device": "cuda:2",
                "tensor_parallel_size": 2,
                "gpu_memory_utilization": 0.5,
            },
            "trainer": {"device": "cuda:0"},
        }
    )
    plan = make_plan(vllm, prompt_tokens=24, device_bytes=GIB)
    assert [(n, d, e.total) for n, d, e in plan.processes[1:]] == [
        ("explorer-0 tp0", "cuda:2", GIB // 2),
        ("explorer-0 tp1", "cuda:3", GIB // 2),
    ]


def test_a_plan_whose_vllm_shares_run_would_refuse_does_not_fit():
    """Bytes may fit while vLLM's fixed shares do not (``explorer.gpu_memory_utilization``
    per engine + the trainer's cap on one GPU): plan says so, as ``streamrft run`` would."""
    cfg = from_dict(
        {
            "taskset": {"path": "x.jsonl"},
            "model": {"device": "cuda"},
            "explorer": {"engine": "vllm", "gpu_memory_utilization": 0.35},
            "trainer": {"gpu_memory_fraction": 0.55},
            "eval": {"count": 1},
        }
    )
    plan = make_plan(cfg, prompt_tokens=24, device_bytes=80 * GIB)
    assert all(total <= 80 * GIB for total in plan.by_device().values())
    assert "2 vLLM engine(s) (explorers, evaluators) x 0.35" in plan.shares_refused
    assert plan.fits() is False
    alone = make_plan(from_dict({**msgspec.to_builtins(cfg), "eval": {"count": 0}}), 24, 80 * GIB)
    assert alone.shares_refused is None and alone.fits() is True


def test_the_staging_copy_is_on_the_device_or_in_host_memory_beside_it():
    """``synchronizer.staging``: ``device`` counts a version (and with LoRA the adapter
    beside its base) on the explorer's GPU; ``host`` on a GPU box puts it in pinned host
    memory, outside the GPU's total and on a line of its own; on a CPU the device is host
    memory; ``none`` has no copy."""
    base = {
        "taskset": {"path": "x.jsonl"},
        "model": {"device": "cuda", "dtype": "bfloat16"},
        "explorer": {"device": "cuda:1"},
        "trainer": {"device": "cuda:0"},
    }

    def explorer(staging: str, **more):
        sync = {"staging": staging, "method": "object_store"}
        cfg = from_dict({**base, "synchronizer": sync, **more})
        plan = make_plan(cfg, 16, 80 * GIB)
        return plan, plan.processes[1][2]

    plan, on_gpu = explorer("device")
    version = 2 * plan.shape.params  # bfloat16
    assert on_gpu.parts["staging"] == version and not on_gpu.host
    assert plan.by_device()["cuda:1"] == on_gpu.total
    plan, beside = explorer("host")
    assert beside.host == {"staging": version} and "staging" not in beside.parts
    assert on_gpu.total - beside.total == version
    assert "host memory beside the GPUs (pinned but a vLLM engine's): explorer-0 staging" in (
        render(plan)
    )
    assert as_json(plan)["processes"][1]["host"] == {"staging": version}
    _, none = explorer("none")
    assert none.total == beside.total and not none.host
    lora = {"model": {**base["model"], "lora": {"enabled": True, "rank": 4}}}
    plan, adapter = explorer("device", **lora)
    assert adapter.parts["staging"] == version + 4 * plan.work.trainable
    cpu = from_dict({"taskset": {"path": "x.jsonl"}})  # host memory is the device's
    row = make_plan(cpu, 16, GIB).processes[1][2]
    assert row.parts["staging"] == 4 * make_plan(cpu, 16, GIB).shape.params


def _rows(sync: dict, **more) -> tuple[dict, int]:
    """The plan's rows by name, of a bf16 run on GPUs with ``synchronizer: sync``: the
    trainer on cuda:0, explorer 0 beside it, explorer 1 on cuda:1; and the version's bytes."""
    cfg = {
        "taskset": {"path": "x.jsonl"},
        "model": {"device": "cuda", "dtype": "bfloat16"},
        "explorer": {"count": 2, "devices": ["cuda:0", "cuda:1"]},
        "trainer": {"device": "cuda:0", "gpu_memory_fraction": 0.3},
        "synchronizer": sync,
        **more,
    }
    plan = make_plan(from_dict(cfg), 16, 80 * GIB)
    return {n: e for n, _, e in plan.processes}, 2 * plan.shape.params


def test_the_device_path_counts_the_trainers_slots_and_stages_on_the_gpu_that_reads_them():
    """``auto`` (or ``cuda_ipc``) from a trainer on a GPU, full weights: the trainer keeps
    two versions on its GPU; the explorer on that GPU stages its versions there whatever
    ``staging`` says (``host``: the shared-memory and store versions in pinned host memory
    beside it), or, with ``none``, keeps the receiver's buffer there; the explorer on
    another GPU (shown only its own) does not read the slots."""
    rows, version = _rows({"method": "auto", "staging": "host"})
    assert rows["trainer"].parts["ipc_slots"] == 2 * version
    beside, other = rows["explorer-0"], rows["explorer-1"]
    assert beside.parts["staging"] == version and beside.host == {"staging": version}
    assert "staging" not in other.parts and other.host == {"staging": version}
    rows, _ = _rows({"method": "cuda_ipc", "staging": "host"})  # no shared-memory versions
    assert rows["explorer-0"].parts["staging"] == version and not rows["explorer-0"].host
    rows, _ = _rows({"method": "auto", "staging": "none"})
    assert rows["explorer-0"].parts["ipc_buffer"] == version and not rows["explorer-0"].host
    assert "ipc_buffer" not in rows["explorer-1"].parts
    lora = {"model": {"device": "cuda", "dtype": "bfloat16", "lora": {"enabled": True}}}
    rows, _ = _rows({"method": "auto", "staging": "host"}, **lora)  # adapters: shared memory
    assert "ipc_slots" not in rows["trainer"].parts and "staging" not in rows["explorer-0"].parts
    rows, _ = _rows({"method": "object_store", "staging": "host"})
    assert "ipc_slots" not in rows["trainer"].parts and "staging" not in rows["explorer-0"].parts


def test_device_staging_of_shared_memory_versions_keeps_a_pinned_host_buffer_too():
    """A shared-memory version is read into pinned host memory, then copied to the GPU:
    with ``staging: device`` that buffer is kept beside the staging copy."""
    rows, version = _rows({"method": "shared", "staging": "device"})
    for name in ("explorer-0", "explorer-1"):
        assert rows[name].parts["staging"] == version
        assert rows[name].host == {"shm_buffer": version}
    rows, _ = _rows({"method": "object_store", "staging": "device"})
    assert not rows["explorer-1"].host


def test_a_vllm_engines_mirror_and_staging_copy_are_host_memory():
    """vLLM's engine keeps the torch model versions are received into on the CPU: that
    mirror and its staging copy are host memory, not its GPU's; reading the trainer's slots
    it keeps the receiver's buffer on its GPU."""
    engines = {"count": 2, "devices": ["cuda:0", "cuda:1"], "gpu_memory_utilization": 0.3}
    rows, version = _rows(
        {"method": "auto", "staging": "device"}, explorer={**engines, "engine": "vllm"}
    )
    for name in ("explorer-0", "explorer-1"):
        assert rows[name].host == {"mirror": version, "staging": version}
        assert "staging" not in rows[name].parts
    assert rows["explorer-0"].parts["ipc_buffer"] == version  # on the trainer's GPU
    assert rows["explorer-1"].parts == {"vllm_share": int(0.3 * 80 * GIB)}
