"""Shared fixtures: one real broker and one real S3 server per test session.

Tests get fresh uuid run ids (so fresh topics and consumer groups); nothing is mocked.

Two backends serve the same :class:`Endpoints`, chosen with ``--services`` or the
``STREAMRFT_TEST_SERVICES`` environment variable (the option wins):

- ``local``: the embedded Tansu broker and JuiceFS S3 gateway, as child processes.
- ``containers``: Apache Kafka and MinIO in Docker through testcontainers (the
  ``containers`` extra); the only backend that runs the ``real_kafka`` tests.
- ``auto`` (default): ``containers`` when testcontainers is installed and a Docker daemon
  answers, else ``local``.
"""

from __future__ import annotations

import os
import uuid

import pytest

from streamrft.infra.access import STRICT_ENV as ACCESS_STRICT
from tests.helpers.paths import ADDITION

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every streamrft process a test starts (they inherit it) fails at once on a Kafka access
# its role's row of infra/access.py does not list: the run's ACLs are generated from it
os.environ[ACCESS_STRICT] = "1"

BACKENDS = ("auto", "local", "containers")
BACKEND_ENV = "STREAMRFT_TEST_SERVICES"
_backend_key = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--services",
        choices=BACKENDS,
        default=None,
        help=f"where the broker and object store of integration tests run: local processes "
        f"(Tansu + JuiceFS), containers (Apache Kafka + MinIO through testcontainers), or "
        f"auto (containers when Docker answers); default: ${BACKEND_ENV} or auto",
    )


def _requested(config: pytest.Config) -> tuple[str, str]:
    """The backend asked for and where it was asked (for messages)."""
    if config.getoption("--services"):
        return config.getoption("--services"), "--services"
    requested = os.environ.get(BACKEND_ENV) or "auto"
    if requested not in BACKENDS:
        raise pytest.UsageError(f"{BACKEND_ENV}={requested!r}: expected one of {BACKENDS}")
    return requested, BACKEND_ENV


def pytest_configure(config: pytest.Config) -> None:
    """Refuse an explicit ``containers`` backend at once when Docker cannot serve it."""
    requested, source = _requested(config)
    if requested == "containers":
        from tests.helpers.containers import docker_problem

        problem = docker_problem()
        if problem is not None:
            raise pytest.UsageError(
                f"{source}=containers: {problem}. Start Docker, or run with "
                f"--services=local (or {BACKEND_ENV}=local) for the embedded services."
            )
        config.stash[_backend_key] = "containers"


def _backend(config: pytest.Config) -> str:
    """The session's backend, ``local`` or ``containers``; ``auto`` asks Docker once."""
    if _backend_key not in config.stash:
        requested, _ = _requested(config)
        if requested == "auto":
            from tests.helpers.containers import docker_problem

            requested = "local" if docker_problem() else "containers"
        config.stash[_backend_key] = requested
    return config.stash[_backend_key]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``real_kafka`` tests, before any fixture starts, unless on Apache Kafka."""
    if item.get_closest_marker("real_kafka") and _backend(item.config) != "containers":
        pytest.skip(
            "needs Apache Kafka: runs only on the containers backend (--services=containers, "
            "or auto with testcontainers installed and a Docker daemon); this session uses "
            "the embedded Tansu broker, which lacks the feature"
        )


@pytest.fixture(scope="session")
def services_backend(pytestconfig: pytest.Config) -> str:
    """Which backend :func:`services` runs on: ``"local"`` or ``"containers"``."""
    return _backend(pytestconfig)


@pytest.fixture(scope="session")
def services(services_backend, tmp_path_factory):
    """A Kafka broker and an S3 server, started once per session (see the module docstring)."""
    if services_backend == "containers":
        from tests.helpers.containers import running_containers

        with running_containers() as eps:
            yield eps
        return

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
        return from_dict(base)

    return factory
