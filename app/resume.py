"""Resuming a run: which config fields a resumed run must keep, and the check.

``streamrft run CONFIG --run-id ID`` on a run folder that exists continues the run: the
trainer from its latest checkpoint (step, optimizer, model version, consumed offsets,
seen experience ids), the feeder after the epochs it already published. Some fields
cannot change across that: the checkpoint's tensors fit one model shape, the topics have
their partitions, the task ids and order come from the taskset and the seed. A change to
one of them is refused at start-up, naming the field; anything else (learning rate,
batch sizes, step budget, explorer count, intervals) may change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import yaml

from streamrft.infra.config import Config
from streamrft.schemas.errors import ConfigError

FIXED_ON_RESUME = (
    "model",
    "run.seed",
    "taskset.path",
    "taskset.sources",
    "taskset.epoch_tasks",
    "taskset.max_prompt_tokens",
    "taskset.id_key",
    "taskset.shuffle",
    "trainer.batch_size",  # the feeder stamps batches of this many tasks (Task.batch)
    "algorithm.type",
    "algorithm.advantage_fn",
    "algorithm.policy_loss_fn",
    "algorithm.kl_penalty_fn",
    "algorithm.kl_loss_fn",
    "trainer.engine",
    "kafka.topic_prefix",
    "kafka.partitions",
    "object_store.bucket",
    "synchronizer.method",
)
"""Dotted prefixes of the fields a resumed run must keep."""


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resume_conflicts(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Fields under :data:`FIXED_ON_RESUME` whose values differ, as ``field: old -> new``.

    Both arguments are config trees (``msgspec.to_builtins(cfg)`` or a loaded YAML); a
    field missing from ``previous`` (a config written by an older version) counts as equal.
    """
    old, new = _flatten(previous), _flatten(current)
    conflicts = []
    for field in sorted(new):
        if not any(field == p or field.startswith(p + ".") for p in FIXED_ON_RESUME):
            continue
        if field in old and _norm(old[field]) != _norm(new[field]):
            conflicts.append(f"{field}: {old[field]!r} -> {new[field]!r}")
    return conflicts


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def check_resume(cfg: Config) -> bool:
    """Refuse a resume whose config changed a fixed field; True when the run folder holds
    an earlier attempt (its ``config.yaml``)."""
    path = Path(cfg.run_dir) / "config.yaml"
    if not path.is_file():
        return False
    try:
        previous = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: the earlier attempt's config is not valid YAML: {exc}") from exc
    conflicts = resume_conflicts(previous, msgspec.to_builtins(cfg))
    if conflicts:
        raise ConfigError(
            f"run {cfg.run.id} exists in {cfg.run_dir} and cannot resume with a changed "
            + "; ".join(conflicts)
            + " (keep these fields, or start a new run id)"
        )
    return True
