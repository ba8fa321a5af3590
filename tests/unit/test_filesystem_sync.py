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
