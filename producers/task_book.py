"""The run's training tasks, read once and checked: what the feeder publishes from.

:class:`TaskBook` reads ``taskset.path`` (or every one of ``taskset.sources``) row by row
into a :class:`TaskFile`: every task's workflow known, no task id twice (found with an
8-byte digest a task, then confirmed on the rows), prompts longer than
``taskset.max_prompt_tokens`` left out and counted. ``streamrft validate`` builds the same
book, so what it accepts the feeder accepts.
"""

from __future__ import annotations

import hashlib
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from streamrft.infra.config import Config, TasksetConfig
from streamrft.infra.taskset import training_tasks
from streamrft.producers.task_file import TaskFile
from streamrft.producers.workflows import check_workflow
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import Task

SCREEN_BATCH = 512
"""Prompts measured in one tokenizer call against ``taskset.max_prompt_tokens``."""


class TaskBook:
    """The run's tasks in a :class:`TaskFile` in ``folder``, written once and checked."""

    def __init__(self, cfg: Config, folder: Path) -> None:
        self.taskset = cfg.taskset
        self.file = TaskFile(folder)
        self.sizes = [0] * max(len(cfg.taskset.sources), 1)
        """Tasks kept per source."""
        self.marked = [False] * len(self.sizes)
        """Per source: whether a task id holds ``#`` (the mark of a repeated copy)."""
        self.too_long = 0
        """Tasks left out for their prompt's length."""
        try:
            self._read(cfg)
        except BaseException:
            self.file.close()
            raise

    def _read(self, cfg: Config) -> None:
        digests = array("Q")
        renderer = _renderer(cfg)
        limit = cfg.taskset.max_prompt_tokens
        pending: list[tuple[int, Task]] = []
        workflows: set[str] = set()
        for source, _where, task in training_tasks(cfg.taskset):
            if task.workflow not in workflows:
                check_workflow(task.workflow)
                workflows.add(task.workflow)
            pending.append((source, task))
            if len(pending) == SCREEN_BATCH:
                self._keep(pending, renderer, limit, digests)
        self._keep(pending, renderer, limit, digests)
        self.file.seal()
        self._check_ids(digests)
        t = cfg.taskset
        empty = [s.path for s, n in zip(t.sources, self.sizes, strict=False) if not n]
        if not len(self.file) or empty:
            raise ConfigError(
                f"taskset {', '.join(empty) or t.path}: no task left with a prompt of at most "
                f"{t.max_prompt_tokens} tokens (taskset.max_prompt_tokens)"
            )

    def _keep(
        self, pending: list[tuple[int, Task]], renderer: Any, limit: int, digests: array
    ) -> None:
        """Append ``pending`` but the tasks whose prompt (``renderer``: measured) is longer
        than ``limit`` tokens; empties ``pending``."""
        tasks = [t for _, t in pending]
        lengths = renderer.lengths(tasks) if renderer else [0] * len(pending)
        for (source, task), length in zip(pending, lengths, strict=True):
            if renderer and length > limit:
                self.too_long += 1
                continue
            self.file.append(task)
            self.sizes[source] += 1
            self.marked[source] = self.marked[source] or "#" in task.id
            digests.append(_digest(task.id))
        pending.clear()

    def _check_ids(self, digests: array) -> None:
        """A :class:`ConfigError` naming a task id two rows share, and where they are."""
        values = np.frombuffer(digests, dtype=np.uint64)
        order = np.argsort(values, kind="stable")
        for k in np.flatnonzero(values[order][1:] == values[order][:-1]):
            task_id = self.file[int(order[k])].id
            if task_id == self.file[int(order[k + 1])].id:
                rows = [w for _, w, t in training_tasks(self.taskset) if t.id == task_id]
                raise ConfigError(f"taskset: duplicate task id {task_id!r} ({' and '.join(rows)})")

    def close(self) -> None:
        self.file.close()


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _renderer(cfg: Config) -> Any:
    """The prompt renderer that measures prompts against ``taskset.max_prompt_tokens``
    (None: no limit). Loads the model's tokenizer (transformers, only then)."""
    if not cfg.taskset.max_prompt_tokens:
        return None
    from streamrft.infra.modeling import load_tokenizer
    from streamrft.infra.prompts import PromptRenderer

    return PromptRenderer.from_config(cfg.taskset, load_tokenizer(cfg.model))


def check_shares(taskset: TasksetConfig, book: TaskBook, shares: list[int]) -> None:
    """A :class:`ConfigError` for a mix in which a source gets no task of an epoch, or in
    which a source repeated within an epoch holds ids with ``#`` (its copies' ids, ``id#1``,
    could then be another row's)."""
    for source, n, share, marked in zip(
        taskset.sources, book.sizes, shares, book.marked, strict=True
    ):
        if not share:
            raise ConfigError(
                f"taskset.sources: {source.label!r} gets 0 of an epoch's {sum(shares)} tasks "
                f"at weight {source.weight:g}; raise its weight or taskset.epoch_tasks"
            )
        if share > n and marked:
            raise ConfigError(
                f"taskset.sources: {source.label!r} is repeated within an epoch ({share} of "
                f"its {n} tasks) and has ids with '#', which its copies' ids (id#1, id#2) "
                "could collide with; give it ids without '#' or a smaller share"
            )
