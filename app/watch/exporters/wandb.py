"""Weights & Biases: one W&B run per streamrft run (its id and name are the run id).

``monitor.wandb.mode: offline`` (the default) writes only local files,
``<monitor.wandb.dir or run dir>/wandb/offline-run-<time>-<run id>/``, and touches no
network: no login, no error reporting, no git, no system stats, no code or requirements
capture. ``wandb sync <that folder>`` uploads them later; several folders of the same run
id (an export again) are synced in order as one resumed run. Each component has its own
step axis: ``define_metric("<component>/*", step_metric="<component>/step")``, and every
event is one row of ``<component>/<metric>`` values with ``<component>/step`` (:mod:`.names`).

W&B's files cannot be queried for what was already logged, so the newest ``created_at``
logged of each metric is kept beside them in ``wandb/streamrft-<run id>.marks.json``
(written once the run is finished); an export again logs only values created later
(:mod:`.marks`). ``close`` finishes the run and shuts down W&B's service process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import wandb

from streamrft.app.watch.exporters.marks import Watermarks
from streamrft.app.watch.exporters.names import folder, points, step_metric
from streamrft.infra.config import Config
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.events import MetricsEvent

QUIET_ENV = {"WANDB_ERROR_REPORTING": "false", "WANDB_DISABLE_GIT": "true"}
"""Set for this process before W&B starts its service: no error reports to W&B's servers."""


def wandb_dir(cfg: Config) -> Path:
    """``monitor.wandb.dir``, or the run folder (W&B adds ``wandb/`` under it)."""
    return Path(cfg.monitor.wandb.dir) if cfg.monitor.wandb.dir else cfg.run_dir


def marks_path(cfg: Config) -> Path:
    """The newest ``created_at`` logged of each metric (JSON: name -> Unix time)."""
    return wandb_dir(cfg) / "wandb" / f"streamrft-{cfg.run.id}.marks.json"


class WandbExporter:
    name = "wandb"

    def __init__(self, cfg: Config) -> None:
        conf = cfg.monitor.wandb
        base = wandb_dir(cfg)
        base.mkdir(parents=True, exist_ok=True)
        self.where = str(base / "wandb")
        self._marks_path = marks_path(cfg)
        marks = json.loads(self._marks_path.read_text()) if self._marks_path.is_file() else {}
        self._marks = Watermarks(marks)
        if conf.mode == "offline":
            for key, value in QUIET_ENV.items():
                os.environ.setdefault(key, value)
        settings = wandb.Settings(
            console="off",
            silent=True,
            disable_git=True,
            disable_code=True,
            x_disable_stats=True,
            x_disable_meta=True,
            x_save_requirements=False,
        )
        try:
            self.run = wandb.init(
                project=conf.project,
                id=cfg.run.id,
                name=cfg.run.id,
                mode=conf.mode,
                dir=str(base),
                resume="allow",
                settings=settings,
            )
        except wandb.errors.Error as exc:  # online without an account, a bad project...
            wandb.teardown()
            raise ConfigError(
                f"monitor.wandb: W&B did not start a run ({exc}); mode: offline needs no account"
            ) from exc
        self._components: set[str] = set()
        self._closed = False

    def write(self, ev: MetricsEvent) -> None:
        fresh = self._marks.fresh(points(ev), ev.created_at or time.time())
        if not fresh:
            return
        component = folder(ev.component)
        if component not in self._components:
            self._components.add(component)
            self.run.define_metric(step_metric(ev.component))
            self.run.define_metric(f"{component}/*", step_metric=step_metric(ev.component))
        row = {p.name: p.value for p in fresh}
        row[step_metric(ev.component)] = ev.step
        self.run.log(row)

    def flush(self) -> None:
        """Nothing to do: each row went to W&B's service at ``write``, which writes it."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.run.finish()
            # the marks are noted only once W&B has written the values: a crash before this
            # logs them again on the next export rather than losing them
            self._marks_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._marks_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._marks.marks, sort_keys=True))
            tmp.replace(self._marks_path)
        finally:
            wandb.teardown()
