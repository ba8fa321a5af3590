"""The shared-memory method's uris and host ids: a hostile uri on the control topic never
names a file outside /dev/shm, and a bad ``run.host_id`` is a config error."""

from __future__ import annotations

import pytest

from streamrft.infra.config import from_dict
from streamrft.schemas.errors import ConfigError, SyncError
from streamrft.sync.shared import SCHEME, parse_uri
from tests.helpers.paths import ADDITION

pytestmark = pytest.mark.unit


def test_a_well_formed_uri_names_a_host_and_a_file():
    assert parse_uri(f"{SCHEME}box-1/streamrft-r-12-0") == ("box-1", "streamrft-r-12-0")


@pytest.mark.parametrize(
    "uri",
    [
        f"{SCHEME}host/../../etc/passwd",  # a path, not a file name
        f"{SCHEME}host/sub/file",
        f"{SCHEME}host/.hidden",
        f"{SCHEME}host/",
        f"{SCHEME}/file",
        "s3://bucket/key",
        "file:///dev/shm/x",
        f"{SCHEME}host/" + "x" * 10,  # fine: a plain name
    ],
)
def test_hostile_uris_are_refused(uri):
    if uri.endswith("x" * 10):
        assert parse_uri(uri)[1] == "x" * 10
        return
    with pytest.raises(SyncError):
        parse_uri(uri)


@pytest.mark.parametrize("bad", ["a/b", "../x", "host id", "x" * 129])
def test_a_host_id_that_could_not_name_a_host_is_a_config_error(bad):
    taskset = {"path": str(ADDITION)}
    with pytest.raises(ConfigError, match="host_id"):
        from_dict({"run": {"host_id": bad}, "taskset": taskset})
    cfg = from_dict({"run": {"host_id": "gpu-node-7.cluster"}, "taskset": taskset})
    assert cfg.run.host_id == "gpu-node-7.cluster"
