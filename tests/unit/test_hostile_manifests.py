"""Manifests a crafted event can point at, each refused as an IntegrityError (a rejected
version) before anything is fetched or allocated: file names that leave the version's
folder, sizes that disagree, a manifest this code cannot decode, another run's version."""

from __future__ import annotations

import hashlib
import json

import pytest

from streamrft.schemas import IntegrityError
from streamrft.schemas.events import ModelVersionReady
from streamrft.sync.filesystem import FolderStore
from streamrft.sync.versions import fetch_manifest, fetch_version

pytestmark = pytest.mark.unit

SHARD = {"name": "model-00001-of-00001.safetensors", "sha256": "0" * 64, "bytes": 10}


def _manifest(**changes) -> dict:
    return {
        "version": 3,
        "step": 3,
        "run": "run-a",
        "shards": [SHARD],
        "total_bytes": 10,
        "created_at": 0.0,
        **changes,
    }


def _event(store: FolderStore, manifest: dict | bytes, run: str = "run-a", size: int = 10):
    blob = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    key = f"{run}/v00000003/manifest.json"
    store.put(key, blob, "application/json")
    return ModelVersionReady(
        version=3,
        method="filesystem",
        uri=store.uri(key),
        manifest_sha256=hashlib.sha256(blob).hexdigest(),
        bytes=size,
        step=3,
    )


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"shards": [{**SHARD, "name": "../../../etc/passwd"}]}, "file name"),
        ({"shards": [{**SHARD, "name": "/etc/passwd"}]}, "file name"),
        ({"shards": [{**SHARD, "name": "manifest.json"}]}, "file name"),
        ({"files": [{"name": "..", "sha256": "0" * 64, "bytes": 1}]}, "file name"),
        ({"shards": [{**SHARD, "bytes": 10**15}]}, "shards hold 1000000000000000 bytes"),
        ({"total_bytes": 11}, "its total says 11"),
        ({"version": "one"}, "Expected `int`"),  # digest-consistent, not a manifest
    ],
)
def test_hostile_manifests_are_integrity_errors(tmp_path, changes, match):
    store = FolderStore(tmp_path)
    with pytest.raises(IntegrityError, match=match):
        fetch_version(store, _event(store, _manifest(**changes)), "run-a")


def test_event_and_manifest_sizes_must_agree(tmp_path):
    store = FolderStore(tmp_path)
    with pytest.raises(IntegrityError, match="the event 99"):
        fetch_manifest(store, _event(store, _manifest(), size=99))


def test_not_json_is_an_integrity_error(tmp_path):
    store = FolderStore(tmp_path)
    with pytest.raises(IntegrityError):
        fetch_manifest(store, _event(store, b"\xff not json"))


def test_another_runs_version_is_refused(tmp_path):
    store = FolderStore(tmp_path)
    event = _event(store, _manifest(run="run-b"), run="run-b")
    with pytest.raises(IntegrityError, match="not where run 'run-a' keeps version 3"):
        fetch_manifest(store, event, "run-a")
    assert fetch_manifest(store, event, "run-b")[1].run == "run-b"
