"""The vLLM engine on the tiny model: its log-probs are the trainer's, weights go in in
place, and a run with ``explorer.engine: vllm`` learns.

vLLM's CPU attention takes head sizes of 32 and up: the tiny models here have two heads of
32 (``num_heads: 2``); the example's four heads of 16 would not load.
"""

from __future__ import annotations

import copy
import json
import re
import time

import pytest
import torch

from streamrft.consumers.batching import collate, response_logprobs
from streamrft.infra.config import LoraConfig, ModelConfig
from streamrft.infra.modeling import load_policy
from streamrft.producers.engines.base import Rollout
from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
from streamrft.schemas.experience import Experience
from streamrft.sync.weights import unique_state_dict
from tests.helpers.cli import run_argv, run_ok
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.vllm

TINY = ModelConfig(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, max_positions=32
)
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """The prompts as the workflows hand them to an engine (raw text, BOS added)."""
    return [list(ids) for ids in tokenizer(prompts, add_special_tokens=True).input_ids]


def sharpened(model: torch.nn.Module, scale: float = 3.0) -> torch.nn.Module:
    """A copy whose (tied) embedding is ``scale`` times larger: peaked next-token
    distributions, so log-probs span a wide range rather than all sitting near -log(V)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        out.get_input_embeddings().weight.mul_(scale)
    return out


def trained_to_answer(model: torch.nn.Module, tokenizer, answer: str, steps: int = 120):
    """A copy of ``model`` fine-tuned to answer every prompt with ``answer`` then EOS."""
    out = copy.deepcopy(model).train()
    ids = torch.tensor(
        [[*p, tokenizer.eos_token_id] for p in prompt_ids(tokenizer, [q + answer for q in PROMPTS])]
    )
    labels = ids.clone()
    labels[:, : len(prompt_ids(tokenizer, ["1+1="])[0])] = -100  # the answer and EOS only
    opt = torch.optim.Adam(out.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        out(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    return out.eval()


def experience(r: Rollout) -> Experience:
    return Experience(
        id="e",
        tokens=pack_i32(r.prompt_ids + r.response_ids),
        prompt_length=len(r.prompt_ids),
        logprobs=pack_f32(r.logprobs),
        action_mask=pack_u8([1] * len(r.response_ids)),
        reward=0.0,
        model_version=0,
    )


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_policy(TINY)
    return sharpened(model), tokenizer


@pytest.fixture(scope="module")
def engine(tiny):
    from streamrft.producers.engines.vllm_engine import VLLMEngine

    model, tokenizer = tiny
    t0 = time.perf_counter()
    eng = VLLMEngine(copy.deepcopy(model), tokenizer)
    print(f"\nvLLM engine start-up: {time.perf_counter() - t0:.1f} s")
    yield eng
    eng.close()


def test_sampled_logprobs_are_the_trainers_recomputation(tiny, engine):
    """Every sampled token's log-prob under ``logits / temperature`` equals what the
    trainer recomputes on the same weights (collate + response_logprobs); responses end
    at their first EOS, or run to max_new_tokens."""
    model, tokenizer = tiny
    temperature, max_new = 0.7, 8
    groups = engine.rollout(prompt_ids(tokenizer, PROMPTS[:32]), 4, temperature, max_new, seed=3)
    rollouts = [r for g in groups for r in g]
    assert [len(g) for g in groups] == [4] * 32
    eos = tokenizer.eos_token_id
    for r in rollouts:
        assert len(r.response_ids) == len(r.logprobs) >= 1
        assert eos not in r.response_ids[:-1]
        assert r.response_ids[-1] == eos or len(r.response_ids) == max_new
        assert r.text == tokenizer.decode(r.response_ids, skip_special_tokens=True)
    assert len({tuple(r.response_ids) for r in rollouts}) > len(groups), "samples all alike"

    batch = collate([experience(r) for r in rollouts], tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = response_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature
        )
    mask = batch.response_mask.bool()
    diff = (trainer[mask] - batch.old_logprobs[mask]).abs()
    print(
        f"\nlog-prob |vLLM - trainer| over {int(mask.sum())} tokens: mean {diff.mean():.2e}, "
        f"max {diff.max():.2e} (log-probs span {batch.old_logprobs[mask].min():.2f}..0)"
    )
    assert batch.old_logprobs[mask].min() < -2.0  # a real spread, not near-uniform
    assert diff.max() < 1e-3 and diff.mean() < 1e-4
    # at temperature 1 the trainer's log-probs differ: vLLM's are of the scaled distribution
    with torch.no_grad():
        unscaled = response_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.prompt_width
        )
    assert (unscaled[mask] - batch.old_logprobs[mask]).abs().max() > 0.1


def test_same_seed_same_samples_and_greedy_is_deterministic(tiny, engine):
    _, tokenizer = tiny
    ids = prompt_ids(tokenizer, PROMPTS[:8])
    a = engine.rollout(ids, 3, 1.0, 6, seed=11)
    b = engine.rollout(ids, 3, 1.0, 6, seed=11)
    assert [[r.response_ids for r in g] for g in a] == [[r.response_ids for r in g] for g in b]
    assert engine.greedy(ids, 6) == engine.greedy(ids, 6)


def test_load_weights_changes_the_samples_in_place(tiny, engine):
    """Weights of a model trained to answer "7" make vLLM answer "7"; the original
    weights put back make it answer as before."""
    model, tokenizer = tiny
    ids = prompt_ids(tokenizer, PROMPTS)
    before = engine.greedy(ids, 4)
    assert before.count("7") < len(PROMPTS) // 2
    sevens = trained_to_answer(model, tokenizer, "7")
    t0 = time.perf_counter()
    engine.load_weights(1, unique_state_dict(sevens))
    print(f"\nload_weights of the full model: {time.perf_counter() - t0:.3f} s")
    assert engine.greedy(ids, 4) == ["7"] * len(PROMPTS)
    samples = [r for g in engine.rollout(ids[:16], 4, 1.0, 4, seed=5) for r in g]
    answered = sum(r.text == "7" and r.response_ids[-1] == tokenizer.eos_token_id for r in samples)
    assert answered >= 0.9 * len(samples)
    engine.load_weights(2, unique_state_dict(model))
    assert engine.greedy(ids, 4) == before


def test_bench_pushes_each_checkpoint_into_the_one_engine(tiny, engine, tmp_path):
    """What ``streamrft bench`` does per checkpoint (``consumers.checkpoint.load_weights``
    with the engine as the target): vLLM's own weights change, so a checkpoint trained to
    answer "7" answers "7", and the next checkpoint (the original weights) as before."""
    from streamrft.consumers.checkpoint import load_weights, save_checkpoint
    from streamrft.consumers.state import TrainerState

    model, tokenizer = tiny
    ids = prompt_ids(tokenizer, PROMPTS)
    before = engine.greedy(ids, 4)
    assert before != ["7"] * len(PROMPTS)
    for step, weights in ((1, trained_to_answer(model, tokenizer, "7")), (2, model)):
        opt = torch.optim.SGD(weights.parameters(), lr=0.0)
        save_checkpoint(tmp_path, TrainerState(step=step, version=step), weights, opt, keep=0)
    assert load_weights(tmp_path / "step_00000001", engine).version == 1
    assert engine.greedy(ids, 4) == ["7"] * len(PROMPTS)
    load_weights(tmp_path / "step_00000002", engine)
    assert engine.greedy(ids, 4) == before


def test_lora_adapter_versions_are_lora_requests(tiny):
    """A LoRA explorer: vLLM starts from the base, an adapter version (peft tensors, as
    published) becomes a new LoRA request and changes the samples; a full version (base
    weights and its adapter) is taken too."""
    from streamrft.producers.engines.vllm_engine import VLLMEngine
    from streamrft.sync.lora import adapter_state_dict, attach_lora

    model, tokenizer = tiny
    lora = LoraConfig(enabled=True, rank=8, alpha=16.0)
    torch.manual_seed(0)
    explorer_model = attach_lora(copy.deepcopy(model), lora)
    engine = VLLMEngine(explorer_model, tokenizer)
    try:
        ids = prompt_ids(tokenizer, PROMPTS)
        before = engine.greedy(ids, 4)
        torch.manual_seed(0)
        trained = trained_to_answer(attach_lora(copy.deepcopy(model), lora), tokenizer, "7")
        engine.load_adapter(1, adapter_state_dict(trained))
        first = engine.adapter
        assert engine.greedy(ids, 4) == ["7"] * len(PROMPTS)
        torch.manual_seed(0)
        engine.load_adapter(2, adapter_state_dict(attach_lora(copy.deepcopy(model), lora)))
        assert engine.adapter.lora_int_id != first.lora_int_id
        assert engine.greedy(ids, 4) == before  # a zero adapter: the base again
        engine.load_weights(3, unique_state_dict(trained))  # base + the trained adapter
        assert engine.greedy(ids, 4) == ["7"] * len(PROMPTS)
    finally:
        engine.close()


CPU_BACKEND = "streamrft-cpu-buffers"
CPU_BUFFERS: dict[int, torch.Tensor] = {}
"""The chunk buffers of the CPU stand-in for CUDA IPC, by the handle the sender exported."""


def cpu_buffers(workers: int, nbytes: int):
    """The transfer path's buffers on the CPU: one in this process (the one worker's),
    exported as a number the backend below looks it up by."""
    from streamrft.producers.engines.vllm_transfer import WorkerBuffer

    def export(buffer: torch.Tensor) -> int:
        CPU_BUFFERS[len(CPU_BUFFERS)] = buffer
        return len(CPU_BUFFERS) - 1

    assert workers == 1
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    return [WorkerBuffer("cpu", buffer, lambda: export(buffer), lambda: None)]


def register_cpu_backend() -> None:
    """vLLM's own IPC backend with the two steps a CPU lacks replaced: the chunk is read
    from a buffer of this process (:data:`CPU_BUFFERS`) where a GPU opens a CUDA IPC
    handle, and no device is synchronized. Start, finish (vLLM's layerwise reload), the
    update info's checks, the unpacking and the model's ``load_weights`` are vLLM's."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    class CPUBuffersEngine(IPCWeightTransferEngine):
        def update_weights(self, update_info):
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info):
            assert self.packed, "the sender announces packed chunks at init"
            packed = CPU_BUFFERS[update_info.ipc_handles["cpu"]]
            dtypes = [getattr(torch, name) for name in update_info.dtype_names]
            weights = unpack_tensor(
                packed[: sum(update_info.tensor_sizes)],
                update_info.names,
                update_info.shapes,
                dtypes,
                update_info.tensor_sizes,
            )
            self.model.load_weights([(name, t.clone()) for name, t in weights])

    try:
        WeightTransferEngineFactory.register_engine(CPU_BACKEND, CPUBuffersEngine)
    except ValueError:  # registered by an earlier test of this process
        pass


def test_versions_go_in_through_vllms_weight_transfer_protocol(tiny):
    """The ``transfer`` path (how GPU workers in processes of their own take versions) on
    vLLM's CPU build, one worker: the engine's sender packs each version and drives
    vLLM's init / start / update / finish, and vLLM's IPC backend (its CUDA step replaced:
    :func:`register_cpu_backend`) loads it. Weights trained to answer "7" answer "7"; the
    original weights, sent in many small chunks, answer as before."""
    from vllm.config import WeightTransferConfig

    from streamrft.producers.engines.vllm_engine import VLLMEngine, unique_base_weights
    from streamrft.producers.engines.vllm_transfer import TransferSender

    register_cpu_backend()
    model, tokenizer = tiny
    engine = VLLMEngine(
        copy.deepcopy(model),
        tokenizer,
        weight_path="transfer",
        buffers=cpu_buffers,
        weight_transfer_config=WeightTransferConfig(backend=CPU_BACKEND),
    )
    try:
        ids = prompt_ids(tokenizer, PROMPTS)
        before = engine.greedy(ids, 4)
        assert before.count("7") < len(PROMPTS) // 2
        sevens = trained_to_answer(model, tokenizer, "7")
        exported = len(CPU_BUFFERS)
        t0 = time.perf_counter()
        engine.load_weights(1, unique_state_dict(sevens))
        print(
            f"\nload_weights through the weight-transfer protocol: {time.perf_counter() - t0:.3f} s"
        )
        assert len(CPU_BUFFERS) == exported + 1  # one chunk: the tiny model fits in one
        assert engine.greedy(ids, 4) == ["7"] * len(PROMPTS)
        small = TransferSender(engine.llm, 1, cpu_buffers, chunk_bytes=32 * 1024)
        chunks = small.send(2, unique_base_weights(model))
        assert len(chunks) >= 4, [c.nbytes for c in chunks]
        assert sum(len(c.names) for c in chunks) == len(unique_base_weights(model))
        assert engine.greedy(ids, 4) == before
    finally:
        engine.close()


def test_vllm_without_weight_transfer_refuses_with_a_sync_error(engine):
    """An engine built without ``weight_transfer_config`` (the CPU's in-process path):
    vLLM's refusal reaches the caller as a SyncError naming the call."""
    from streamrft.producers.engines.vllm_transfer import TransferSender
    from streamrft.schemas.errors import SyncError

    assert engine.weight_path == "in_process"
    with pytest.raises(SyncError, match=r"vLLM refused init_weight_transfer_engine at start: "):
        TransferSender(engine.llm, 1, cpu_buffers)


def test_a_run_with_the_vllm_engine_learns(tmp_path):
    """``streamrft run`` on the arithmetic example (two heads of 32) with the vLLM explorer:
    reward and greedy accuracy rise, versions are applied, the books balance."""
    summary_path = tmp_path / "summary.json"
    steps = 60
    t0 = time.perf_counter()
    run_ok(
        run_argv(
            EXAMPLE,
            None,
            steps,
            tmp_path / "runs",
            None,
            "explorer.engine=vllm",
            "model.num_heads=2",
            "eval.interval=20",
            summary=summary_path,
        ),
        tmp_path,
        timeout=900,
    )
    s = json.loads(summary_path.read_text())
    print(
        f"\nvLLM run: {steps} steps in {time.perf_counter() - t0:.0f} s; reward "
        f"{s['mean_reward_first']:.3f} -> {s['mean_reward_last']:.3f}, eval accuracy "
        f"{s['eval_accuracy']}"
    )
    assert s["steps"] == steps
    assert s["mean_reward_last"] >= s["mean_reward_first"] + 0.1
    # greedy errors at least halve (the warm-up may already answer most sums: 0.85 at
    # step 0 with two heads, where a gain of a fixed size could not fit under 1.0)
    first, last = s["eval_accuracy_first"], s["eval_accuracy_last"]
    assert last > first and 1 - last <= (1 - first) / 2, s["eval_accuracy"]
    books = s["books"]
    assert books == {**books, "trained_twice": 0, "newer_than_trainer": 0, "staler_than_max": 0}
    assert s["versions_published"] == steps + 1
    assert s["versions_applied"]["explorer-0"] >= steps // 2
    assert s["versions_rejected"] == {"explorer-0": 0}
    assert s["exit_codes"] == {"trainer": 0, "explorer-0": 0, "feeder": 0}
    # the default method (auto) hands the vLLM engine its versions through shared memory
    (log,) = (tmp_path / "runs").glob("*/logs/explorer-0.log")
    applied = re.findall(r"explorer-0: applied version \d+ \((\w+)\)", log.read_text())
    assert applied and set(applied) == {"shared"}, applied


def test_a_tensor_parallel_engine_samples_as_one_and_takes_versions_from_a_file(tiny, monkeypatch):
    """``explorer.tensor_parallel_size`` 2 on vLLM's CPU build: two worker processes split
    the model and answer greedily as the transformers engine does on the same weights; a version reaches them
    as a file (each reloads its shard from it), so weights trained to answer "7" make it
    answer "7", the original weights put back answer as before, and each version's file
    replaces the one before. Last in this file: shutting its workers down tears down vLLM's
    process-wide parallel state, which an engine built after it in this process would need."""
    from streamrft.infra.config import ExplorerConfig
    from streamrft.producers.engines.vllm_engine import make_vllm_engine

    model, tokenizer = tiny
    import vllm.envs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one NUMA node: bind by hand
    vllm.envs.disable_envs_cache()  # the first engine cached the environment it saw
    ids = prompt_ids(tokenizer, PROMPTS)
    from streamrft.producers.engines import TransformersEngine

    one = TransformersEngine(model, tokenizer).greedy(ids, 4)
    cfg = ExplorerConfig(engine="vllm", tensor_parallel_size=2)
    split = make_vllm_engine(copy.deepcopy(model), tokenizer, cfg)
    try:
        assert split.workers == 2
        assert split.weight_path == "file"  # vllm-cpu: neither CUDA IPC nor NCCL
        before = split.greedy(ids, 4)
        assert before == one
        sevens = trained_to_answer(model, tokenizer, "7")
        t0 = time.perf_counter()
        split.load_weights(1, unique_state_dict(sevens))
        print(f"\nload_weights over 2 workers (a file): {time.perf_counter() - t0:.3f} s")
        assert split.greedy(ids, 4) == ["7"] * len(PROMPTS)
        split.load_weights(2, unique_state_dict(model))
        assert split.greedy(ids, 4) == before
        assert [p.name for p in split._dir.glob("version-*")] == ["version-2"]
    finally:
        split.llm.llm_engine.engine_core.shutdown()
        split.close()
