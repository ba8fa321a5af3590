"""Shared fixtures: one real broker and one real S3 server per test session.

Tests get fresh uuid run ids (so fresh topics and consumer groups); nothing is mocked.
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.helpers.paths import ADDITION

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """The embedded Tansu broker and JuiceFS S3 gateway, started once per session."""
    from streamrft.infra.local.services import LocalServices

    svc = LocalServices(tmp_path_factory.mktemp("services"))
    eps = svc.start()
    try:
        yield eps
    finally:
        svc.stop()


@pytest.fixture
def make_config(services, tmp_path):
    """Build a Config for a fresh run on the session's services: ``make_config(**sections)``."""
    import msgspec

    from streamrft.infra.config import from_dict

    def factory(**sections) -> object:
        base = {
            "run": {"name": "t", "id": f"t-{uuid.uuid4().hex[:12]}", "dir": str(tmp_path / "runs")},
            "kafka": {"bootstrap_servers": services.bootstrap_servers},
            "object_store": {
                "endpoint": services.s3_endpoint,
                "access_key": services.access_key,
                "secret_key": services.secret_key,
                "bucket": f"b-{uuid.uuid4().hex[:12]}",
            },
            "taskset": {"path": str(ADDITION)},
            "model": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_layers": 1,
                "num_heads": 4,
                "max_positions": 32,
            },
        }
        for name, values in sections.items():
            base.setdefault(name, {}).update(values)
        cfg = from_dict(base)
        assert isinstance(cfg, msgspec.Struct)
        return cfg

    return factory
