"""``deploy/grafana/streamrft-run.json``: it parses as a Grafana dashboard, and every query
asks only for what the probes export: family names the collectors yield, labels they set,
and metric and counter names the product's code sends."""

from __future__ import annotations

import asyncio
import json
import re

import msgspec
import pytest

from streamrft.app.watch.monitor import RunMonitor
from streamrft.app.watch.run_probes import RunProbes
from streamrft.infra.config import Config
from streamrft.infra.metric_families import LABELS
from streamrft.infra.probes import ProcessProbes
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.unit

DASHBOARD = ROOT / "deploy" / "grafana" / "streamrft-run.json"
PRODUCT = ("schemas", "infra", "sync", "producers", "consumers", "app")


def _exported_families() -> set[str]:
    """Every family the per-process and the run's collectors yield."""
    cfg = msgspec.structs.replace(Config(), run=msgspec.structs.replace(Config().run, id="r"))

    async def run_families() -> set[str]:
        following = asyncio.create_task(asyncio.sleep(1))
        probes = RunProbes(RunMonitor(cfg), following, {}, lambda: 0.0)
        names = {f.name for f in probes.collect()}
        following.cancel()
        return names

    process = ProcessProbes("r", "trainer", "trainer", 60.0, lambda: True)
    return {f.name for f in process.collect()} | asyncio.run(run_families())


def _source() -> str:
    return "\n".join(path.read_text() for top in PRODUCT for path in (ROOT / top).rglob("*.py"))


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def test_the_dashboard_parses_and_has_its_run_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "streamrft-run" and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "label_values(streamrft_step, run)" in variables["run"]["definition"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'run="$run"' in target["expr"], (panel["title"], target["expr"])


def test_every_query_asks_only_for_exported_names():
    dashboard = json.loads(DASHBOARD.read_text())
    exported, source = _exported_families(), _source()
    # the names of the metrics and counters the code sends, as string literals
    metric_names = set(re.findall(r'"([a-z]+/[a-z_0-9]+)"', source))
    counter_names = set(re.findall(r'counters\.(?:add|set)\(\s*"([a-z_]+)"', source))
    used_labels = set()
    for expr in _queries(dashboard):
        for family in re.findall(r"\bstreamrft_[a-z_]+", expr):
            assert family in exported, (family, expr)
        for selector in re.findall(r"streamrft_[a-z_]+\{([^}]*)\}", expr):
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', selector))
            used_labels |= set(pairs)
            name = pairs.get("name")
            if name is None:
                continue
            if "streamrft_metric{" in expr:
                assert name in metric_names, (name, expr)
            else:
                assert name in counter_names, (name, expr)
    assert used_labels <= {*LABELS, "name", "state"}, used_labels
    assert {"train/reward_mean", "eval/accuracy"} <= metric_names  # the scan finds them
