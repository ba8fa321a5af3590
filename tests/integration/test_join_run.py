"""A process started by hand finds the broker and object store of the run it joins."""

from __future__ import annotations

import pytest

from streamrft.app.cli import _load, build_parser
from streamrft.infra.config import (
    ObjectStoreConfig,
    load_config,
    to_yaml,
    with_endpoints,
    with_run_id,
)
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


def test_embedded_store_has_a_generated_secret_that_a_joining_process_reads(tmp_path):
    """The embedded object store never runs on the public default secret (at 41ac149 it
    did: anyone on the host could read and replace the weight versions); the secret is
    kept in the owner-only state file, whence a process joining the run takes it."""
    from minio import Minio
    from minio.error import S3Error

    runs = tmp_path / "runs"
    svc = LocalServices(runs / "joined" / "services", broker=False)
    eps = svc.start()
    try:
        record = svc.record()
        assert eps.secret_key != ObjectStoreConfig().secret_key and len(eps.secret_key) >= 32
        assert record.stat().st_mode & 0o777 == 0o600
        public = Minio(eps.s3_endpoint, "streamrft", ObjectStoreConfig().secret_key, secure=False)
        with pytest.raises(S3Error, match=r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied"):
            public.list_buckets()
        cfg = _load(_explore_args(runs, "joined"), joining=True)
        assert cfg.object_store.endpoint == eps.s3_endpoint
        assert cfg.object_store.secret_key == eps.secret_key
        own = Minio(
            eps.s3_endpoint, cfg.object_store.access_key, cfg.object_store.secret_key, secure=False
        )
        own.list_buckets()  # the credentials the joining process got work
    finally:
        svc.stop()
    other = LocalServices(tmp_path / "other", broker=False)
    assert other.secret_key != eps.secret_key  # one per services instance


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
