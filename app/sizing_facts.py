"""The facts :mod:`app.sizing` sizes by, read from disk and torch: the model folder's size,
context and chat template, a bounded sample of the data's prompts and answers counted in
the model's tokens, a few of the model's own responses to the data's first prompts, and
the GPUs there are (or the ones given for another machine)."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from streamrft.app.model_shapes import context_of
from streamrft.app.sizing import DataFacts, Hardware, ModelFacts, OwnResponses
from streamrft.infra.config import ModelConfig, TasksetConfig
from streamrft.infra.memory_plan import GIB
from streamrft.schemas.errors import ConfigError

SAMPLE_ROWS = 1000
"""Most rows of the data read to size by (the first ones)."""
RESPONSE_CAP = 2048
"""Most tokens a response sampled on a GPU may run to: four times the GSM8K recipes' 512,
past which a response to a task of a few lines is rambling rather than working it out."""
CPU_RESPONSE_CAP = 512
"""Most tokens a response sampled on a CPU may run to: there the time grows faster than the
length (each token copies the whole KV cache). SmolLM2-135M-Instruct sampled one response
of 128 tokens in 4.6 s, of 512 in 19.4 s, of 2,048 in 425 s (2-core dev box, 2 threads,
float32, others' load 2-3, 2026-12-06): a model that never ends costs init 20 s a
response at this cap, and an explorer on a CPU would sample longer responses as slowly."""
CPU_SAMPLE_PARAMS = 600_000_000
"""A larger model's responses are not sampled on a CPU: SmolLM2-135M-Instruct (see
:data:`CPU_RESPONSE_CAP`) takes under a minute for 8 responses of about 100 tokens, a model
four times its size (Qwen2.5-0.5B) minutes, one of 1.5B far longer (run ``init`` where its
GPU is)."""


def model_facts(folder: Path, tokenizer: Any) -> ModelFacts:
    """The model in ``folder`` (its ``config.json``; the safetensors headers for the exact
    parameter count) and whether ``tokenizer`` has a chat template."""
    from streamrft.app.plan import model_shape
    from streamrft.infra.prompts import has_chat_template

    try:
        conf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: cannot read {folder}/config.json: {exc}") from exc
    shape = model_shape(ModelConfig(source="path", path=str(folder)))
    return ModelFacts(folder.name, shape.params, context_of(conf), has_chat_template(tokenizer))


def load_tokenizer_of(folder: Path) -> Any:
    from streamrft.infra.modeling import load_tokenizer

    return load_tokenizer(ModelConfig(source="path", path=str(folder)))


def data_facts(taskset: TasksetConfig, path: str, tokenizer: Any) -> DataFacts:
    """The first :data:`SAMPLE_ROWS` tasks of ``path`` read as ``taskset`` reads them: each
    prompt rendered as the explorer renders it and each answer field as written, counted
    in ``tokenizer``'s tokens."""
    from streamrft.infra.prompts import PromptRenderer

    tasks, extracted, exhausted = _answered_tasks(taskset, path, SAMPLE_ROWS)
    answers = [task.answer for task in tasks]
    prompts = PromptRenderer.from_config(taskset, tokenizer).lengths(tasks)
    eos = 1
    counted = [len(ids) + eos for ids in tokenizer(answers, add_special_tokens=False).input_ids]
    worked = bool(taskset.answer_extract) and sum(map(len, answers)) > 2 * sum(map(len, extracted))
    total = len(tasks) if exhausted else _parquet_rows(Path(path))
    return DataFacts(
        where=Path(path).name,
        sampled=len(tasks),
        total=total,
        prompt_tokens=tuple(sorted(prompts)),
        answer_tokens=tuple(sorted(counted)),
        worked=worked,
    )


def _answered_tasks(
    taskset: TasksetConfig, path: str, limit: int
) -> tuple[list[Any], list[Any], bool]:
    """``(tasks, answers, whether those were every row)``: of the first ``limit``
    rows of ``path``, the tasks whose answer field ``taskset``'s extractor reads (the
    feeder skips the others), and what it reads there."""
    from streamrft.infra.answer_extract import answer_extractor
    from streamrft.infra.taskset import iter_tasks

    raw = msgspec.structs.replace(taskset, answer_extract=None, path=path, sources=[])
    rows = list(itertools.islice(iter_tasks(path, raw), limit + 1))
    exhausted = len(rows) <= limit
    rows = rows[:limit]
    extract = answer_extractor(taskset.answer_extract) if taskset.answer_extract else None
    tasks, extracted = [], []
    for _where, task in rows:
        found = extract(task.answer) if extract else task.answer
        if found is None:
            continue  # the feeder skips it too
        tasks.append(task)
        extracted.append(found)
    if not tasks:
        raise ConfigError(f"taskset: no task with an answer in the first {len(rows)} of {path}")
    return tasks, extracted, exhausted


Progress = Callable[[int, int], None]
"""``progress(done, total)``: called before the first response and after each."""


def model_responses(
    folder: Path,
    taskset: TasksetConfig,
    path: str,
    *,
    count: int,
    temperature: float,
    device: str,
    context: int,
    cap: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> OwnResponses:
    """``count`` responses of the model in ``folder``, one to each of the first ``count``
    tasks of ``path`` (read as ``taskset`` reads them, rendered as the explorer renders
    them), sampled by the explorer's engine at ``temperature`` on ``device`` (``init``'s
    answer: a GPU where torch sees one, else the CPU), each up to ``cap`` tokens (None:
    :data:`RESPONSE_CAP` on a GPU, :data:`CPU_RESPONSE_CAP` on the CPU; less where the
    model's ``context`` leaves less after the longest of those prompts) and ended by the
    EOS. Seeded (response ``i`` by ``seed + i``), so the same model and data give the
    same lengths; torch's global state is left as found. A model that cannot be loaded or
    sample is a :class:`ConfigError` naming ``--sample-responses``."""
    import torch

    from streamrft.infra.config import ModelConfig
    from streamrft.infra.modeling import load_policy
    from streamrft.infra.prompts import PromptRenderer
    from streamrft.producers.engines.transformers_engine import TransformersEngine

    tasks = _answered_tasks(taskset, path, count)[0]
    where = sampling_device(device)
    model_cfg = ModelConfig(
        source="path",
        path=str(folder),
        device=where,
        dtype="float32" if where == "cpu" else "bfloat16",
    )
    threads = torch.get_num_threads()
    if progress:
        progress(0, len(tasks))
    try:
        torch.set_num_threads(max(1, min(threads, _cpus())))
        with torch.random.fork_rng(devices=[]), _quiet_loading():
            model, tokenizer = load_policy(model_cfg)  # may draw from the global generator
        prompts = PromptRenderer.from_config(taskset, tokenizer).batch(tasks)
        most = cap or (CPU_RESPONSE_CAP if where == "cpu" else RESPONSE_CAP)
        room = context - max(map(len, prompts)) if context else most
        limit = max(1, min(most, room))
        engine = TransformersEngine(model, tokenizer)
        lengths, cut = [], 0
        for i, ids in enumerate(prompts):
            (rollout,) = engine.rollout([ids], 1, temperature, limit, seed + i)[0]
            lengths.append(len(rollout.response_ids))
            cut += rollout.truncated
            if progress:
                progress(i + 1, len(prompts))
    except (RuntimeError, MemoryError, ValueError) as exc:  # out of memory, cannot generate
        raise ConfigError(
            f"--sample-responses: cannot sample {folder.name}'s responses on {where}: "
            f"{type(exc).__name__}: {exc} (--sample-responses 0 sizes from the data alone)"
        ) from exc
    finally:
        torch.set_num_threads(threads)
    return OwnResponses(tuple(sorted(lengths)), cut, limit, temperature)


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' "Loading weights" bar off (it would break init's progress line)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def sampling_device(device: str) -> str:
    """Where ``init`` samples the model: ``device`` (its answer) where torch can use it
    here, else the CPU (a config for another machine's GPUs is written on this one)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    if device == "auto":
        return "cuda"
    index = torch.device(device).index
    return device if index is None or index < torch.cuda.device_count() else "cuda"


def _cpus() -> int:
    """CPUs this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def why_not_sampled(folder: Path, params: int, device: str) -> str | None:
    """Why the model in ``folder`` (of ``params`` parameters) is not sampled on ``device``
    (:func:`sampling_device`), or None: it is."""
    from streamrft.app.plan import safetensors_params

    if not safetensors_params(folder):
        return f"{folder.name} holds no weights"
    if sampling_device(device) == "cpu" and params > CPU_SAMPLE_PARAMS:
        return (
            f"a {params / 1e9:.1f}B model samples too slowly on a CPU (over "
            f"{CPU_SAMPLE_PARAMS / 1e9:g}B); run init where its GPU is"
        )
    return None


def _parquet_rows(path: Path) -> int | None:
    """Rows of a Parquet file, from its footer (None for other files)."""
    if path.suffix != ".parquet" or not path.is_file():
        return None
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


def hardware(gpus: int | None, gpu_bytes: int | None, device: str = "auto") -> Hardware:
    """The GPUs to size for: ``gpus`` and ``gpu_bytes`` as given (a config for another
    machine), else what torch sees here; ``device`` (``init``'s answer) ``cpu`` means none,
    a ``cuda`` device at least one."""
    vllm = importlib.util.find_spec("vllm") is not None
    if gpus is not None:
        memory = f", {gpu_bytes / GIB:.0f} GiB each" if gpu_bytes else ""
        return Hardware(gpus, gpu_bytes, vllm, f"{gpus} GPU(s) as given (--gpus){memory}")
    if device == "cpu":
        return Hardware(0, None, vllm, "model.device cpu as answered")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        if device.startswith("cuda"):
            return Hardware(1, gpu_bytes, vllm, f"model.device {device} (no GPU visible here)")
        return Hardware(0, None, vllm, "no GPU visible to torch here")
    props = torch.cuda.get_device_properties(0)
    memory_bytes = gpu_bytes or int(props.total_memory)
    seen = f"torch sees {count} GPU(s) here ({props.name}, {memory_bytes / GIB:.0f} GiB)"
    return Hardware(count, memory_bytes, vllm, seen)
