"""The filesystem sync method: same two-phase protocol over a shared folder."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas import IntegrityError, SyncError
from streamrft.sync.filesystem import READ_CHUNK, FilesystemLoader, FilesystemPublisher, FolderStore
from streamrft.sync.versions import fetch_file
from streamrft.sync.weights import apply_state_dict, unique_state_dict

pytestmark = pytest.mark.unit

CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, max_positions=32)


def _pair():
    tok = build_char_tokenizer()
    import msgspec

    return build_tiny_model(CFG, tok), build_tiny_model(msgspec.structs.replace(CFG, seed=1), tok)


def test_publish_fetch_apply_and_extra_files(tmp_path):
    src, dst = _pair()
    pub = FilesystemPublisher(tmp_path / "weights", "run-a", max_shard_bytes=20_000)
    event = pub.publish(unique_state_dict(src), 5, 5, extra_files={"notes.json": b'{"a": 1}'})
    assert event.method == "filesystem" and event.uri.startswith("file://")
    files = sorted(p.name for p in (tmp_path / "weights" / "run-a" / "v00000005").iterdir())
    assert files[-1] == "notes.json" and "manifest.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1  # sharded by size
    assert not [f for f in files if f.startswith(".")]  # no temporary files left
    loader = FilesystemLoader(tmp_path / "weights")
    apply_state_dict(dst, loader.fetch(event))
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fetch_file(loader.store, event, "notes.json") == b'{"a": 1}'


def test_tampered_shard_and_foreign_uri_are_rejected(tmp_path):
    src, _ = _pair()
    pub = FilesystemPublisher(tmp_path / "w", "run-b", max_shard_bytes=1 << 30)
    event = pub.publish(unique_state_dict(src), 1, 1)
    shard = next((tmp_path / "w" / "run-b" / "v00000001").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        FilesystemLoader(tmp_path / "w").fetch(event)
    with pytest.raises(SyncError, match="outside"):
        FilesystemLoader(tmp_path / "elsewhere").fetch(event)


def test_folder_store_reads_in_chunks_hashed_as_it_reads(tmp_path):
    store = FolderStore(tmp_path)
    data = os.urandom(2 * READ_CHUNK + 12_345)  # three chunks, the last one short
    store.write("v/shard", [memoryview(data[:100]), memoryview(data[100:])], "x")
    buf, digest = store.get_hashed("v/shard", len(data))
    assert digest == hashlib.sha256(data).hexdigest()
    assert buf.dtype == torch.uint8 and bytes(buf.numpy()) == data
    assert not [p for p in (tmp_path / "v").iterdir() if p.name.startswith(".")]
    with pytest.raises(IntegrityError, match=f"{len(data) - 1} bytes, the manifest says"):
        store.write("v/shard", [memoryview(data[:-1])], "x")
        store.get_hashed("v/shard", len(data))


@pytest.mark.parametrize("folder", ["with space", "per%25cent", "ünï"])
def test_a_folder_with_a_space_percent_or_unicode_name_works(tmp_path, folder):
    src, dst = _pair()
    root = tmp_path / folder / "weights"
    event = FilesystemPublisher(root, "run-c", 1 << 20).publish(unique_state_dict(src), 2, 2)
    apply_state_dict(dst, FilesystemLoader(root, "run-c").fetch(event))
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_uris_leaving_the_folder_are_refused(tmp_path):
    root = tmp_path / "weights"
    (root / "run").mkdir(parents=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("not weights")
    (root / "run" / "link").symlink_to(secret)
    store = FolderStore(root)
    for uri in (
        f"file://{root}/../secret.txt",
        f"file://{root}/run/%2E%2E/%2E%2E/secret.txt",
        f"file://{root}/run/link",  # a symbolic link out of the folder
        "file:///etc/passwd",
        f"file://{root}",
    ):
        with pytest.raises(SyncError, match=r"outside synchronizer\.fs_dir"):
            store.key(uri)
    with pytest.raises(SyncError, match="outside"):
        store.get("../secret.txt")
    assert store.key(store.uri("run/v00000001/manifest.json")) == "run/v00000001/manifest.json"


def test_a_fifo_or_a_device_is_refused_without_blocking(tmp_path):
    store = FolderStore(tmp_path)
    os.mkfifo(tmp_path / "pipe")  # reading it would wait for a writer for ever
    with pytest.raises(IntegrityError, match="not a regular file"):
        store.get("pipe")
    with pytest.raises(IntegrityError, match="not a regular file"):
        store.get_hashed("pipe", 10)


def test_a_shard_claiming_more_than_its_file_allocates_nothing(tmp_path):
    store = FolderStore(tmp_path)
    store.write("v/shard", [memoryview(b"x" * 100)], "x")
    with pytest.raises(IntegrityError, match="100 bytes, the manifest says 1000000000000000"):
        store.get_hashed("v/shard", 10**15)  # checked before torch.empty(10**15)
