"""``streamrft validate CONFIG [-o KEY=VALUE ...] [--connect]``: check a config without
starting anything.

Loading the file checks every field and the rules between fields; then each thing the
config names that a process would only find wrong once started: the taskset (and the eval
set) read through, each task's workflow known, the reward, rollout engine, train engine,
algorithm and sample strategy names, the model folder (its config and tokenizer files;
the weights are not loaded) and the device's spelling. A device is resolved without being
required: ``cuda:1`` on a machine without that GPU is reported, not refused, since the
config may be meant for another machine. ``--connect`` also reaches the broker and the
object store the config names.

Every check runs and is reported, each on its line: a missing task file or model folder
fails its own line, not the others. A real model's sizes are checked last
(``app/sizing.py``): values that suit the tiny model and not this one (responses the
data's answers would not fit, a learning rate far from the model size's usual one, small
groups for a group-based algorithm, ...) are warnings; ``--strict`` makes them errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamrft.infra.config import Config
from streamrft.schemas.errors import ConfigError, StreamRFTError

CONNECT_TIMEOUT_S = 15.0
"""Longest wait for the broker or the store with ``--connect``."""


@dataclass(frozen=True)
class Check:
    """One thing checked: what, whether it passed, and what was found (or what is wrong)."""

    name: str
    ok: bool
    detail: str
    warnings: tuple[str, ...] = ()
    """What passed but looks wrong, each ``field: why``."""


EXPECTED_DATA = (
    "a JSONL or Parquet file, a folder of them as a dataset hub's download lays it out, "
    "or a folder of a saved dataset"
)


def _missing_files(cfg: Config, fields: tuple[str, ...]) -> None:
    """A :class:`ConfigError` naming each task file of ``fields`` that is not there."""
    from streamrft.infra.config import task_paths

    missing = [
        f"{field}: {value!r} does not exist (expected {EXPECTED_DATA})"
        for field, value in task_paths(cfg).items()
        if field.startswith(fields) and not Path(value).exists()
    ]
    if missing:
        raise ConfigError("; ".join(missing))


def _model_missing(cfg: Config) -> bool:
    return cfg.model.source == "path" and not (Path(str(cfg.model.path)) / "config.json").is_file()


def _taskset(cfg: Config) -> str:
    import tempfile

    import msgspec

    from streamrft.producers.task_book import TaskBook

    _missing_files(cfg, ("taskset",))
    t = cfg.taskset
    unmeasured = ""
    if t.max_prompt_tokens and _model_missing(cfg):  # no tokenizer to measure prompts with
        unmeasured = "; prompt lengths not measured (no model folder: see model)"
        cfg = msgspec.structs.replace(cfg, taskset=msgspec.structs.replace(t, max_prompt_tokens=0))
    with tempfile.TemporaryDirectory(prefix="streamrft-validate-") as folder:
        book = TaskBook(cfg, Path(folder))  # what the feeder reads, checked as it checks
        book.close()
    left_out = (
        f"; {book.too_long} left out with prompts over {t.max_prompt_tokens} tokens"
        if book.too_long
        else unmeasured
    )
    if not t.sources:
        return f"{book.sizes[0]} tasks in {t.path}{left_out}"
    return (
        "; ".join(
            f"{n} tasks in {s.path} (weight {s.weight:g})"
            for s, n in zip(t.sources, book.sizes, strict=True)
        )
        + left_out
    )


def _eval_set(cfg: Config) -> str:
    from streamrft.infra.taskset import read_taskset

    e = cfg.eval
    if not e.path:
        return "none (evaluation uses the training taskset)" + (
            f", its first {e.max_tasks} tasks" if e.max_tasks else ""
        )
    _missing_files(cfg, ("eval",))
    found = len(read_taskset(e.path, cfg.taskset))
    used = f", the first {e.max_tasks} used (eval.max_tasks)" if 0 < e.max_tasks < found else ""
    return f"{found} tasks in {e.path}{used}"


def _names(cfg: Config) -> str:
    from streamrft.consumers.algorithms.presets import resolve_algorithm
    from streamrft.consumers.strategies import check_strategy
    from streamrft.consumers.train_engine import check_train_engine
    from streamrft.producers.engines import check_engine
    from streamrft.producers.rewards import get_reward

    get_reward(cfg.explorer.reward, cfg.explorer.reward_skips_thinking, cfg.reward)
    check_engine(cfg.explorer.engine)
    if cfg.eval.engine is not None:
        check_engine(cfg.eval.engine, "eval.engine")
    check_train_engine(cfg.trainer.engine)
    check_strategy(resolve_algorithm(cfg).spec)
    return (
        f"reward {cfg.explorer.reward}, engine {cfg.explorer.engine}"
        + (f" (evaluators: {cfg.eval.engine})" if cfg.eval.engine else "")
        + f", trainer "
        f"{cfg.trainer.engine}, algorithm {cfg.algorithm.type}"
    )


def _model(cfg: Config) -> str:
    m = cfg.model
    if m.source == "tiny":
        return f"tiny ({m.num_layers} layers, {m.hidden_size} wide), built at start"
    folder = Path(str(m.path))
    if not folder.is_dir():
        raise StreamRFTError(
            f"model.path: {folder} is not a folder (expected a local Hugging Face model "
            "folder: config.json, a tokenizer, *.safetensors; nothing is downloaded)"
        )
    if not (folder / "config.json").is_file():
        raise StreamRFTError(f"model.path: {folder} has no config.json")
    tokenizer = [n for n in ("tokenizer.json", "tokenizer_config.json") if (folder / n).is_file()]
    if not tokenizer:
        raise StreamRFTError(f"model.path: {folder} has no tokenizer (tokenizer.json)")
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    if not weights:
        raise StreamRFTError(f"model.path: {folder} has no *.safetensors weights")
    return f"{folder}: config.json, {tokenizer[0]}, {len(weights)} safetensors file(s)"


def _device(cfg: Config) -> str:
    """Where each role goes (:func:`placement`), each device described as seen here."""
    from streamrft.app.placement import placement

    rows = placement(cfg)
    return "; ".join(
        f"{role} {', '.join(_describe(d) for d in devices.split(','))}" for role, devices, _ in rows
    )


def _describe(spec: str) -> str:
    import torch

    if spec == "auto":
        return f"auto: {'cuda' if torch.cuda.is_available() else 'cpu'} here"
    device = torch.device(spec)
    if device.type != "cuda":
        return spec
    if not torch.cuda.is_available():
        return f"{spec} (no GPU visible here: fine for a config meant for another machine)"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"{spec} (only {count} GPU(s) visible here)"
    return f"{spec} ({torch.cuda.get_device_name(device)})"


def _broker(cfg: Config) -> str:
    from streamrft.infra import admin

    if not cfg.kafka.bootstrap_servers:
        return "none named (`streamrft run` starts an embedded one)"

    async def topics() -> list[str]:
        return await asyncio.wait_for(admin.list_topics(cfg.kafka), CONNECT_TIMEOUT_S)

    try:
        found = asyncio.run(topics())
    except asyncio.TimeoutError as exc:  # not the builtin one before Python 3.11
        raise StreamRFTError(
            f"{cfg.kafka.bootstrap_servers}: no answer in {CONNECT_TIMEOUT_S:.0f}s"
        ) from exc
    own = [t for t in found if t.startswith(f"{cfg.kafka.topic_prefix}.")]
    return f"{cfg.kafka.bootstrap_servers}: reached, {len(own)} streamrft topics"


def _store(cfg: Config) -> str:
    from streamrft.sync.object_store import make_client, store_error

    store = cfg.object_store
    if not store.endpoint:
        return "none named (`streamrft run` starts an embedded one)"
    client = make_client(store)
    try:
        exists = client.bucket_exists(store.bucket)
    except Exception as exc:  # the SDK's errors and urllib3's: all say the store is not usable
        raise store_error(f"reaching {store.endpoint}", exc) from exc
    state = "exists" if exists else "will be created by the trainer"
    return f"{store.endpoint}: reached, bucket {store.bucket} {state}"


def _sizes(cfg: Config) -> tuple[str, list[str]]:
    """A real model's sizes against its data and size (:func:`app.sizing.warnings`)."""
    from streamrft.app import sizing
    from streamrft.app.sizing_facts import data_facts, load_tokenizer_of, model_facts
    from streamrft.consumers.algorithms.presets import resolve_algorithm
    from streamrft.infra.taskset import source_config

    folder = Path(str(cfg.model.path))
    tokenizer = load_tokenizer_of(folder)
    model = model_facts(folder, tokenizer)
    t = cfg.taskset
    reading = source_config(t, t.sources[0]) if t.sources else t  # the first source's rows
    data = None
    if Path(reading.path).exists():
        data = data_facts(reading, reading.path, tokenizer)
    found = sizing.warnings(cfg, model, data, resolve_algorithm(cfg).spec.advantage_fn)
    e = cfg.explorer
    seen = (
        f"{data.sampled} answers sampled, 95% within {data.answer_p95} tokens"
        if data is not None
        else "the data not sampled: see taskset"
    )
    detail = (
        f"{model.name}, {sizing.size_text(model.params)} parameters: max_new_tokens "
        f"{e.max_new_tokens} ({seen}), lr {cfg.trainer.lr:g}, groups of {e.repeat_times}"
    )
    return detail, found


def validate(cfg: Config, connect: bool = False) -> list[Check]:
    """Every check of the module docstring on a loaded config (``connect``: the broker and
    store too)."""
    steps: list[tuple[str, Callable[[Config], str]]] = [
        ("taskset", _taskset),
        ("eval set", _eval_set),
        ("names", _names),
        ("model", _model),
        ("device", _device),
    ]
    if connect:
        steps += [("broker", _broker), ("object store", _store)]
    out = []
    for name, fn in steps:
        try:
            out.append(Check(name, True, fn(cfg)))
        except (StreamRFTError, OSError, ValueError, RuntimeError) as exc:
            out.append(Check(name, False, str(exc)))
    model_ok = next(c.ok for c in out if c.name == "model")
    if cfg.model.source == "path" and model_ok:
        try:
            detail, found = _sizes(cfg)
            out.append(Check("sizes", True, detail, tuple(found)))
        except (StreamRFTError, OSError, ValueError, RuntimeError) as exc:
            out.append(Check("sizes", False, str(exc)))
    return out


def verdict(checks: list[Check], strict: bool) -> tuple[str, int]:
    """The last line ``validate`` prints, and its exit status: 1 when a check failed, or
    when one warned under ``strict``."""
    failed = [c.name for c in checks if not c.ok]
    warned = sum(len(c.warnings) for c in checks)
    if failed:
        return f"{len(failed)} check(s) failed: {', '.join(failed)}", 1
    if not warned:
        return "config ok", 0
    plural = "s" if warned > 1 else ""
    if strict:
        return f"{warned} warning{plural}, errors under --strict", 1
    return f"config ok with {warned} warning{plural}", 0
