"""Checkpoints in a real S3 server (``consumers/checkpoint_store.py``): a real checkpoint
uploaded, complete only with its manifest, fetched into another folder byte for byte when
newer, refused whole when a file does not match its manifest, and pruned to
``trainer.keep_checkpoints``."""

from __future__ import annotations

import pytest
import torch

from streamrft.consumers.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from streamrft.consumers.checkpoint_store import MANIFEST, CheckpointStore
from streamrft.consumers.state import TrainerState
from streamrft.schemas.errors import IntegrityError

pytestmark = pytest.mark.integration


def saved(root, step: int, scale: float):
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.mul_(scale)
    state = TrainerState(step=step, version=step)
    return save_checkpoint(root, state, model, opt, keep=0), state, model


def test_checkpoints_go_to_the_store_and_come_back_on_another_host(make_config, tmp_path):
    cfg = make_config(trainer={"keep_checkpoints": 2})
    store = CheckpointStore(cfg)
    host_a, host_b = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    assert store.fetch_newer(host_b) is None and store.complete() == []

    folder, state, model = saved(host_a, 2, 1.0)
    uri = store.upload(folder, state)
    assert uri.endswith(f"{cfg.run.id}/checkpoints/step_00000002/{MANIFEST}")
    [(step, manifest)] = store.complete()
    assert step == 2 and manifest["version"] == 2
    assert set(manifest["files"]) == {p.name for p in folder.iterdir()}

    fetched = store.fetch_newer(host_b)
    assert fetched == host_b / "step_00000002" and latest_checkpoint(host_b) == fetched
    for path in folder.iterdir():
        assert (fetched / path.name).read_bytes() == path.read_bytes()
    copy = torch.nn.Linear(4, 3)
    restored = load_checkpoint(fetched, copy, torch.optim.AdamW(copy.parameters(), lr=0.1))
    assert restored.step == 2 and torch.equal(copy.weight, model.weight)
    assert store.fetch_newer(host_b) is None  # as new as the store's: nothing downloaded

    # an upload cut short (files, no manifest) is never read
    folder4, state4, _ = saved(host_a, 4, 2.0)
    store.store.put(f"{cfg.run.id}/checkpoints/step_00000004/model.safetensors", b"x", "x")
    assert [s for s, _ in store.complete()] == [2] and store.fetch_newer(host_b) is None

    # a file that differs from its manifest: refused, nothing installed
    store.upload(folder4, state4)
    key = f"{cfg.run.id}/checkpoints/step_00000004/model.safetensors"
    good = store.store.get(key)
    store.store.put(key, good[:-1] + bytes([good[-1] ^ 1]), "application/octet-stream")
    with pytest.raises(IntegrityError, match=r"model\.safetensors is not what its manifest says"):
        store.fetch_newer(host_b)
    assert latest_checkpoint(host_b) == fetched and not list(host_b.glob(".tmp_*"))
    store.store.put(key, good, "application/octet-stream")
    assert store.fetch_newer(host_b) == host_b / "step_00000004"

    # kept: the newest two, and one marked keep
    (host_a / "step_00000002" / "keep").write_bytes(b"")
    store.upload(host_a / "step_00000002", state)
    for step, scale in ((6, 3.0), (8, 4.0)):
        f, s, _ = saved(host_a, step, scale)
        store.upload(f, s)
    store.prune()
    assert sorted(s for s, _ in store.complete()) == [2, 6, 8]
