"""Resuming a run: which config fields a resumed run must keep, and the check.

``streamrft run CONFIG --run-id ID`` on a run folder that exists continues the run: the
trainer from its latest checkpoint (step, optimizer, model version, consumed offsets,
seen experience ids), the feeder after the epochs it already published. Some fields
cannot change across that: the checkpoint's tensors fit one model shape, the topics have
their partitions, the task ids and order come from the taskset and the seed. A change to
one of them is refused at start-up, naming the field; anything else (learning rate,
batch sizes, step budget, explorer count, intervals) may change.

A run that finished (:func:`finished_run`: its newest checkpoint is at the
``trainer.max_steps`` its last attempt had) is not resumed by its id alone, which would
train nothing and write an empty summary over its own: ``run --resume`` continues it, with
a ``trainer.max_steps`` above the steps it has, and its earlier summary is kept beside the
new one (:func:`keep_summary`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from streamrft.consumers.checkpoint_folders import latest_checkpoint
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


def _previous(cfg: Config) -> dict[str, Any] | None:
    """The earlier attempt's resolved config (``<run dir>/config.yaml``), if any."""
    path = Path(cfg.run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: the earlier attempt's config is not valid YAML: {exc}") from exc


@dataclass(frozen=True)
class Finished:
    """A run whose last attempt trained every step it was given."""

    step: int
    """The step of its newest checkpoint."""
    max_steps: int
    """The ``trainer.max_steps`` of its last attempt."""
    checkpoint: Path


def finished_run(cfg: Config) -> Finished | None:
    """Run ``cfg``'s folder holds a finished run: its newest complete checkpoint's step is
    at or past the ``trainer.max_steps`` of its last attempt (``config.yaml``). None: no
    earlier attempt, or one with steps left (stopped, killed, failed, or one without a
    step limit)."""
    previous = _previous(cfg)
    if previous is None:
        return None
    max_steps = int((previous.get("trainer") or {}).get("max_steps") or 0)
    ckpt = latest_checkpoint(Path(cfg.run_dir) / "checkpoints")
    if not max_steps or ckpt is None:
        return None
    try:
        step = int(msgspec.json.decode((ckpt / "state.json").read_bytes())["step"])
    except (OSError, ValueError, KeyError, TypeError, msgspec.DecodeError):
        return None  # a damaged checkpoint: the trainer says so when it resumes
    return Finished(step, max_steps, ckpt) if step >= max_steps else None


def check_finished(cfg: Config, resume: bool) -> Finished | None:
    """Refuse to start a finished run again (:func:`finished_run`) unless ``resume``, and
    a resume of one with no step left to train; returns it (None: not finished)."""
    done = finished_run(cfg)
    if done is None:
        if resume and _previous(cfg) is None:
            raise ConfigError(
                f"--resume: there is no run {cfg.run.id} to resume in {cfg.run.dir} (no "
                f"{Path(cfg.run_dir) / 'config.yaml'})"
            )
        return None
    summary = Path(cfg.run_dir) / "summary.json"
    what = (
        f"run {cfg.run.id} finished: its checkpoint {done.checkpoint} is at step {done.step} "
        f"of trainer.max_steps {done.max_steps}"
        + (f" (its summary: {summary})" if summary.is_file() else "")
    )
    if not resume:
        raise ConfigError(
            f"{what}. Starting it again would train nothing: give a new --run-id for a new "
            f"run (or none: one is made), or --resume with --max-steps above {done.step} to "
            "train it further"
        )
    if not cfg.trainer.max_steps or cfg.trainer.max_steps > done.step:
        return done
    raise ConfigError(
        f"--resume: {what}, and trainer.max_steps is {cfg.trainer.max_steps}: nothing left to "
        f"train; raise it above {done.step} (--max-steps N)"
    )


def keep_summary(path: Path) -> Path | None:
    """Move a finished run's summary at ``path`` aside, to the first free
    ``<name>.<n>.json``, so the resumed run's summary does not replace it; returns where
    (None: there was none)."""
    if not path.is_file():
        return None
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(kept)
    return kept


def check_resume(cfg: Config) -> bool:
    """Refuse a resume whose config changed a fixed field; True when the run folder holds
    an earlier attempt (its ``config.yaml``)."""
    previous = _previous(cfg)
    if previous is None:
        return False
    conflicts = resume_conflicts(previous, msgspec.to_builtins(cfg))
    if conflicts:
        raise ConfigError(
            f"run {cfg.run.id} exists in {cfg.run_dir} and cannot resume with a changed "
            + "; ".join(conflicts)
            + " (keep these fields, or start a new run id)"
        )
    return True
