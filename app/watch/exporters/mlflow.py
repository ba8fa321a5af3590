"""MLflow: one MLflow run per streamrft run, in experiment ``monitor.mlflow.experiment``.

The tracking URI is ``monitor.mlflow.tracking_uri``, by default a local file store,
``file:<run dir>/mlruns`` (``mlflow ui --backend-store-uri`` that URI shows it; MLflow 3
asks for ``MLFLOW_ALLOW_FILE_STORE=true`` to open a file store, which this exporter sets
for its own process when the URI is one). The MLflow run is named after the streamrft run
and tagged ``streamrft.run_id``; an export again finds it by that tag, reads the newest
timestamp of each metric back and logs only values created later (:mod:`.marks`).
Metrics are ``<component>/<metric>`` (:mod:`.names`) on the component's step, timestamped
with the event's ``created_at`` (milliseconds), and sent in batches at each flush.

A remote tracking server (``http(s)://``) that is down must fail an export in seconds,
not after MLflow's default of 7 retries with a growing backoff (minutes): the exporter
caps MLflow's HTTP retries and timeout for its process (:data:`HTTP_LIMITS`, each only
where the environment does not set it already). Every MLflow error ends as a
:class:`ConfigError` (opening: the URI or experiment is wrong, or nothing answers there)
or a :class:`ServiceError` (logging, finishing) naming ``monitor.mlflow.tracking_uri``.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from streamrft.app.watch.exporters.marks import Watermarks
from streamrft.app.watch.exporters.names import points
from streamrft.infra.config import Config
from streamrft.schemas.errors import ConfigError, ServiceError
from streamrft.schemas.events import MetricsEvent

RUN_TAG = "streamrft.run_id"
"""Tag of the MLflow run holding a streamrft run's metrics."""
BATCH = 1000
"""Metrics per ``log_batch`` call (MLflow's limit)."""
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
"""MLflow's HTTP settings for a remote tracking URI, unless the environment sets them."""


def tracking_uri(cfg: Config) -> str:
    """``monitor.mlflow.tracking_uri``, or a file store in ``<run dir>/mlruns``."""
    return cfg.monitor.mlflow.tracking_uri or (cfg.run_dir / "mlruns").resolve().as_uri()


def find_run(client: MlflowClient, experiment: str, run_id: str) -> str:
    """The MLflow run id of streamrft run ``run_id`` in ``experiment``; created (and the
    experiment too) when there is none yet."""
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    found = client.search_runs(
        [exp_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1
    )
    if found:
        return found[0].info.run_id
    return client.create_run(exp_id, run_name=run_id, tags={RUN_TAG: run_id}).info.run_id


class MlflowExporter:
    name = "mlflow"

    def __init__(self, cfg: Config) -> None:
        self.where = tracking_uri(cfg)
        scheme = urlparse(self.where).scheme
        if scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        elif scheme in ("http", "https"):
            for key, value in HTTP_LIMITS.items():
                os.environ.setdefault(key, value)
        self.client = MlflowClient(tracking_uri=self.where)
        self._marks = Watermarks()
        try:
            self.run_id = find_run(self.client, cfg.monitor.mlflow.experiment, cfg.run.id or "")
            for key in self.client.get_run(self.run_id).data.metrics:
                for m in self.client.get_metric_history(self.run_id, key):
                    self._marks.seen(key, m.timestamp)
        except MlflowException as exc:
            raise ConfigError(
                f"monitor.mlflow.tracking_uri: no MLflow run at {self.where} ({exc}); check "
                "monitor.mlflow.tracking_uri and monitor.mlflow.experiment"
            ) from exc
        self._pending: list[Metric] = []
        self._closed = False

    def write(self, ev: MetricsEvent) -> None:
        stamp = int((ev.created_at or time.time()) * 1000)
        for p in self._marks.fresh(points(ev), stamp):
            self._pending.append(Metric(p.name, p.value, stamp, p.step))

    def _failed(self, doing: str, exc: MlflowException) -> ServiceError:
        return ServiceError(
            f"monitor.mlflow.tracking_uri: {doing} MLflow run {self.run_id} at {self.where} "
            f"failed: {exc}"
        )

    def flush(self) -> None:
        while self._pending:
            batch = self._pending[:BATCH]
            try:
                self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
            except MlflowException as exc:
                raise self._failed(f"logging {len(batch)} metrics to", exc) from exc
            self._pending = self._pending[BATCH:]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        try:
            self.client.set_terminated(self.run_id, "FINISHED")
        except MlflowException as exc:
            raise self._failed("finishing", exc) from exc
