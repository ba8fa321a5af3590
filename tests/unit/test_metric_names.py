"""The one mapping of metric names for every exporter, the marks that keep a metric's step
from being written twice, and the exporter registry's rules."""

from __future__ import annotations

import logging
import re
import sys

import pytest

from streamrft.app.watch.exporters import EXPORTERS, Backend, backends, open_exporters
from streamrft.app.watch.exporters.marks import Watermarks
from streamrft.app.watch.exporters.names import folder, metric, points, step_metric, tag
from streamrft.infra.config import from_dict
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.events import MetricsEvent
from tests.helpers.paths import ADDITION

MLFLOW_NAME = re.compile(r"^[A-Za-z0-9_\-. /]+$")
KEYS_IN_USE = [
    "train/reward_mean",
    "train/loss",
    "train/staleness_groups_2",
    "eval/accuracy",
    "explorer/reward_mean",
    "trainer/steps",
    "bench/pass@1",
    "bench/pass@4",
]
AWKWARD = ["a:b", "a;b", "a_b", "a//b", "/lead", "trail/", "../up", "./here", "ü/é", "step", " x "]
COMPONENTS = ["trainer", "explorer-0", "explorer-1", "explorer-123-ab12", "bench", "serve"]


def _valid_everywhere(name: str) -> None:
    """MLflow's rules (the strictest backend), checked by hand and by MLflow itself."""
    assert MLFLOW_NAME.match(name), name
    assert len(name) <= 250, name
    assert all(seg not in ("", ".", "..") for seg in name.split("/")), name
    validation = pytest.importorskip("mlflow.utils.validation")
    validation._validate_metric_name(name)  # raises MlflowException when MLflow refuses it


def test_names_in_use_read_as_they_are_and_pass_at_k_becomes_valid():
    assert tag("train/loss") == "train/loss"
    assert metric("explorer-0", "explorer/reward_mean") == "explorer-0/explorer/reward_mean"
    assert tag("bench/pass@4") == "bench/pass_at_4"
    assert metric("bench", "bench/pass@1") == "bench/bench/pass_at_1"
    assert step_metric("explorer-1") == "explorer-1/step"
    for component in COMPONENTS:
        assert folder(component) == component
        for key in KEYS_IN_USE + AWKWARD + ["x" * 400]:
            _valid_everywhere(metric(component, key))


def test_the_mapping_is_stable():
    # the same input gives the same name in every process: fixed expected values, not
    # just two calls in one process (a hash seeded per process would fail this)
    assert tag("a:b") == "a_b-dcea6d"
    assert tag("a//b") == "a/_/b-586cec"
    assert tag("x" * 300) == tag("x" * 300)
    assert len(tag("x" * 300)) <= 190


def test_different_keys_and_components_stay_apart():
    names = [tag(k) for k in KEYS_IN_USE + AWKWARD]
    assert len(set(names)) == len(names), names
    assert tag("x" * 300) != tag("x" * 299 + "y")
    for key in KEYS_IN_USE:
        exported = {metric(c, key) for c in COMPONENTS}
        assert len(exported) == len(COMPONENTS)
    assert folder("a/b") != folder("a_b")
    assert "/" not in folder("a/b")
    # a metric called "step" must not clash with W&B's step metric of its component
    assert metric("trainer", "step") != step_metric("trainer")


def test_points_put_each_value_on_its_components_own_step():
    ev = MetricsEvent(
        run="r",
        component="explorer-1",
        step=7,
        version=3,
        values={"explorer/reward_mean": 0.5, "bench/pass@4": 1},
    )
    got = points(ev)
    assert [(p.name, p.step, p.value) for p in got] == [
        ("explorer-1/explorer/reward_mean", 7, 0.5),
        ("explorer-1/bench/pass_at_4", 7, 1.0),
    ]
    assert got[0].component == "explorer-1" and got[0].tag == "explorer/reward_mean"


def test_watermarks_keep_each_metric_value_of_a_time_once():
    ev = MetricsEvent(run="r", component="trainer", step=2, version=0, values={"train/loss": 1})
    marks = Watermarks()
    marks.seen("trainer/train/loss", 10.0)  # read back from a backend
    assert marks.fresh(points(ev), 10.0) == []  # that value again
    assert [p.step for p in marks.fresh(points(ev), 11.0)] == [2]
    assert marks.fresh(points(ev), 11.0) == []  # the same event again
    other = MetricsEvent(run="r", component="trainer", step=2, version=0, values={"eval/x": 1})
    assert len(marks.fresh(points(other), 11.0)) == 1  # another metric at the same time
    assert marks.skipped == 2


def test_a_restarted_components_lower_steps_are_new_when_later():
    # a first attempt's steps 1..5, then a restarted one counting from 1 again
    marks = Watermarks()
    first = [
        MetricsEvent(run="r", component="explorer-0", step=s, version=0, values={"x": s})
        for s in range(1, 6)
    ]
    for at, ev in enumerate(first):
        assert len(marks.fresh(points(ev), float(at))) == 1
    again = MetricsEvent(run="r", component="explorer-0", step=1, version=0, values={"x": 9})
    assert [(p.step, p.value) for p in marks.fresh(points(again), 100.0)] == [(1, 9.0)]
    assert marks.skipped == 0


def test_unknown_exporter_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError, match="unknown exporter 'tensorbord'") as err:
        backends(["tensorbord"], strict=False)
    for name in EXPORTERS:
        assert name in str(err.value)


def test_names_are_taken_once_each():
    assert [name for name, _ in backends(["mlflow", "mlflow"], strict=True)] == ["mlflow"]


def test_a_missing_package_skips_an_optional_exporter_unless_named(monkeypatch):
    # a registry entry whose package is really not installed
    missing = "streamrft_no_such_package_x"
    monkeypatch.setitem(EXPORTERS, "optional-x", Backend(missing, "optional-x-pip", "x:X", True))
    monkeypatch.setitem(EXPORTERS, "needed-x", Backend(missing, "needed-x-pip", "x:X"))
    assert backends(["optional-x"], strict=False) == []
    with pytest.raises(
        ConfigError, match=r"monitor.exporters: optional-x .*pip install optional-x-pip"
    ):
        backends(["optional-x"], strict=True)
    with pytest.raises(
        ConfigError, match=r"monitor.exporters: needed-x .*pip install needed-x-pip"
    ):
        backends(["needed-x"], strict=False)


def _config(tmp_path):
    return from_dict(
        {
            "run": {"name": "t", "id": "t-broken", "dir": str(tmp_path / "runs")},
            "taskset": {"path": str(ADDITION)},
        }
    )


def _block(monkeypatch, module: str, exporter: str) -> None:
    """Make ``import module`` fail as a broken package's does (Python's own way to block
    an import: a None entry in sys.modules), and forget the exporter's module that
    imports it; both restored after the test."""
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delitem(sys.modules, f"streamrft.app.watch.exporters.{exporter}", raising=False)


def test_an_installed_tensorboard_that_does_not_import_is_skipped_unless_named(
    monkeypatch, tmp_path, caplog
):
    _block(monkeypatch, "tensorboard.summary.writer.event_file_writer", "tensorboard")
    assert EXPORTERS["tensorboard"].installed()  # the package is there: only its import fails
    cfg = _config(tmp_path)
    with caplog.at_level(logging.WARNING, logger="streamrft.app.watch.exporters"):
        assert open_exporters(cfg, ["tensorboard"], strict=False) == []
    assert "monitor.exporters: tensorboard skipped" in caplog.text
    assert "event_file_writer" in caplog.text  # the import error itself
    with pytest.raises(ConfigError, match=r"monitor.exporters: tensorboard: the 'tensorboard' "):
        open_exporters(cfg, ["tensorboard"], strict=True)


def test_a_required_exporter_that_does_not_import_is_a_config_error(monkeypatch, tmp_path):
    _block(monkeypatch, "mlflow.tracking", "mlflow")
    with pytest.raises(ConfigError) as err:
        open_exporters(_config(tmp_path), ["mlflow"], strict=False)
    assert "monitor.exporters: mlflow: the 'mlflow' package is installed but does not" in str(
        err.value
    )
    assert "mlflow.tracking" in str(err.value)  # the import error itself
