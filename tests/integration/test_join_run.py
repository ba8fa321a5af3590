"""A process started by hand finds the broker and object store of the run it joins."""

from __future__ import annotations

import pytest

from streamrft.infra.app.cli import _load, build_parser
from streamrft.infra.config import load_config, to_yaml, with_endpoints, with_run_id
from streamrft.infra.local.services import LocalServices
from streamrft.schemas.errors import StreamRFTError
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.integration


def _explore_args(runs, run_id: str):
    return build_parser().parse_args(
        ["explore", str(EXAMPLE), "--run-id", run_id, "-o", f"run.dir={runs}"]
    )


def test_explore_finds_the_embedded_services_a_run_started(tmp_path):
    runs = tmp_path / "runs"
    svc = LocalServices(runs / "joined" / "services", object_store=False)
    eps = svc.start()
    try:
        svc.record()  # as `streamrft run` does when it starts them
        cfg = _load(_explore_args(runs, "joined"), joining=True)
        assert cfg.kafka.bootstrap_servers == eps.bootstrap_servers
        assert cfg.object_store.endpoint is None  # this run started no object store
    finally:
        svc.stop()
    assert not (runs / "joined" / "services" / "services.json").exists()


def test_explore_refuses_a_run_whose_services_are_gone(tmp_path):
    runs = tmp_path / "runs"
    svc = LocalServices(runs / "ended" / "services", object_store=False)
    svc.start()
    record = svc.record().read_text()
    svc.stop()
    (runs / "ended" / "services" / "services.json").write_text(record)  # left by a crash
    with pytest.raises(StreamRFTError, match=r"embedded services .* not running"):
        _load(_explore_args(runs, "ended"), joining=True)


def test_explore_takes_the_endpoints_of_the_runs_resolved_config(tmp_path):
    runs = tmp_path / "runs"
    resolved = with_endpoints(
        with_run_id(load_config(EXAMPLE, [f"run.dir={runs}"]), "external"),
        "10.0.0.1:9092",
        "10.0.0.2:9000",
    )
    resolved.run_dir.mkdir(parents=True)
    (resolved.run_dir / "config.yaml").write_text(to_yaml(resolved))
    cfg = _load(_explore_args(runs, "external"), joining=True)
    assert (cfg.kafka.bootstrap_servers, cfg.object_store.endpoint) == (
        "10.0.0.1:9092",
        "10.0.0.2:9000",
    )
    # a config that names its own broker keeps it
    args = _explore_args(runs, "external")
    args.override.append("kafka.bootstrap_servers=10.9.9.9:9092")
    cfg = _load(args, joining=True)
    assert (cfg.kafka.bootstrap_servers, cfg.object_store.endpoint) == (
        "10.9.9.9:9092",
        "10.0.0.2:9000",
    )


def test_run_explorers_flag_overrides_the_count(tmp_path):
    args = build_parser().parse_args(
        ["run", str(EXAMPLE), "--explorers", "3", "-o", f"run.dir={tmp_path}"]
    )
    assert _load(args, joining=False).explorer.count == 3
