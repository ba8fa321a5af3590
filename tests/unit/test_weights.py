"""Weight shards, integrity checks, in-place application, and trainer checkpoints."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from streamrft.consumers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from streamrft.consumers.checkpoint_folders import latest_checkpoint
from streamrft.consumers.state import STATE_DECODER, PartitionOffset, TrainerState, id_digest
from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas.errors import IntegrityError, SyncError
from streamrft.sync.weights import (
    apply_state_dict,
    decode_shard,
    sha256_hex,
    shard_state_dict,
    shards_of,
    shared_aliases,
    unique_state_dict,
    verify,
)

pytestmark = [pytest.mark.unit, pytest.mark.numeric]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def tiny(tokenizer, seed: int = 0):
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_positions=32, seed=seed
    )
    return build_tiny_model(cfg, tokenizer)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- shards ----------------------------------------------------------------------------------


def test_shard_state_dict_splits_by_size():
    tensors = {
        "a": torch.arange(10, dtype=torch.float32),  # 40 bytes
        "b": torch.arange(10, dtype=torch.float32) * 2,  # 40 bytes
        "c": torch.ones(30, dtype=torch.float32),  # 120 bytes: larger than a shard
        "d": torch.tensor([7], dtype=torch.int64),  # 8 bytes
        "e": torch.zeros(2, 3, dtype=torch.float16),  # 12 bytes
    }
    shards = list(shard_state_dict(tensors, max_shard_bytes=100))
    assert [names for names, _ in shards] == [["a", "b"], ["c"], ["d", "e"]]
    restored = {}
    for names, data in shards:
        decoded = decode_shard(data, "shard")
        assert sorted(decoded) == sorted(names)
        restored.update(decoded)
    assert restored.keys() == tensors.keys()
    for k, v in tensors.items():
        assert restored[k].dtype == v.dtype
        assert torch.equal(restored[k], v), k


def test_shard_state_dict_one_shard_when_it_fits():
    tensors = {"x": torch.randn(4, 4), "y": torch.randn(3)}
    shards = list(shard_state_dict(tensors, max_shard_bytes=1 << 20))
    assert [names for names, _ in shards] == [["x", "y"]]
    assert list(shard_state_dict({}, 100)) == []


def test_verify_and_flipped_byte():
    data = next(iter(shard_state_dict({"w": torch.randn(8)}, 1 << 20)))[1]
    digest = hashlib.sha256(data).hexdigest()
    assert sha256_hex(data) == digest
    verify(data, digest, "shard 1")  # no error
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    with pytest.raises(IntegrityError, match="shard 1: sha256"):
        verify(bytes(flipped), digest, "shard 1")
    assert issubclass(IntegrityError, SyncError)


def test_decode_shard_rejects_garbage():
    with pytest.raises(IntegrityError, match="not a valid safetensors file"):
        decode_shard(b"\x00" * 3 + b"garbage", "shard 2")


def _mixed() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "h": torch.randn(5, 3, generator=gen).half(),  # 2-byte dtype before wider ones
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "i": torch.arange(5, dtype=torch.int64),
        "f": torch.randn(2, 2, 3, generator=gen),
        "m": torch.tensor([True, False, True]),
        "s": torch.tensor(1.5, dtype=torch.float64),
        "z": torch.zeros(0, 3),
        "u": torch.arange(9, dtype=torch.uint8),
    }


def test_shards_are_views_of_the_tensors_and_plain_safetensors_files(tmp_path):
    tensors = _mixed()
    (shard,) = shards_of(tensors, 1 << 20)
    assert shard.names == list(tensors)
    data = shard.to_bytes()
    assert len(data) == shard.nbytes and (8 + int.from_bytes(data[:8], "little")) % 8 == 0
    assert shard.sha256() == hashlib.sha256(data).hexdigest()
    # every tensor chunk is the tensor's own memory, not a copy
    addresses = {np.frombuffer(c, np.uint8).ctypes.data for c in shard.chunks[1:]}
    assert addresses == {t.data_ptr() for t in tensors.values() if t.numel()}
    # the safetensors library reads it (in memory and from a file, as checkpoints are read)
    (tmp_path / "x.safetensors").write_bytes(data)
    for loaded in (st_load(data), load_file(str(tmp_path / "x.safetensors"))):
        assert loaded.keys() == tensors.keys()
        assert all(
            torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items()
        )


def test_decode_shard_of_a_byte_tensor_returns_views_of_it():
    tensors = _mixed()
    for data in (st_save(tensors), next(iter(shard_state_dict(tensors, 1 << 20)))[1]):
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        lo, hi = buf.data_ptr(), buf.data_ptr() + len(buf)
        decoded = decode_shard(buf, "shard")
        assert decoded.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor), name
            if tensor.numel():
                assert lo <= decoded[name].data_ptr() < hi, name  # no copy
    # a header that lies about a tensor's size is refused
    bad = bytearray(st_save({"w": torch.ones(4)}))
    bad = bad.replace(b'"shape":[4]', b'"shape":[5]')
    with pytest.raises(IntegrityError, match="do not fit"):
        decode_shard(torch.frombuffer(bad, dtype=torch.uint8), "shard 3")


# -- applying weights ------------------------------------------------------------------------


def test_tiny_model_has_tied_embeddings(tokenizer):
    model = tiny(tokenizer)
    assert shared_aliases(model) == {"lm_head.weight"}
    unique = unique_state_dict(model)
    assert "lm_head.weight" not in unique
    assert "model.embed_tokens.weight" in unique
    assert set(unique) == set(model.state_dict()) - {"lm_head.weight"}


def test_apply_state_dict_copies_in_place(tokenizer):
    src, dst = tiny(tokenizer, seed=1), tiny(tokenizer, seed=2)
    assert not torch.equal(src.model.embed_tokens.weight, dst.model.embed_tokens.weight)
    pointers = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    # through the wire format: shards and back
    tensors = {}
    for _, data in shard_state_dict(unique_state_dict(src), max_shard_bytes=16 << 10):
        tensors.update(decode_shard(data, "shard"))
    apply_state_dict(dst, tensors)
    assert_state_equal(snapshot(dst), snapshot(src))
    assert {k: v.data_ptr() for k, v in dst.state_dict().items()} == pointers  # same storage
    # still tied: the output layer follows the embedding it shares
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(dst(ids).logits, src(ids).logits, rtol=0, atol=0)


def test_apply_state_dict_shape_mismatch_leaves_model_unchanged(tokenizer):
    src, dst = tiny(tokenizer, seed=1), tiny(tokenizer, seed=2)
    before = snapshot(dst)
    tensors = unique_state_dict(src)
    last = list(tensors)[-1]
    tensors[last] = torch.zeros(tensors[last].numel() + 1)
    with pytest.raises(SyncError, match=f"{last} is"):
        apply_state_dict(dst, tensors)
    # the tensors before the bad one were not copied either
    assert_state_equal(snapshot(dst), before)


def test_apply_state_dict_missing_or_unexpected_names(tokenizer):
    src, dst = tiny(tokenizer, seed=1), tiny(tokenizer, seed=2)
    before = snapshot(dst)
    missing = unique_state_dict(src)
    del missing["model.norm.weight"]
    with pytest.raises(SyncError, match=r"missing \['model.norm.weight'\]"):
        apply_state_dict(dst, missing)
    extra = {**unique_state_dict(src), "model.extra.weight": torch.zeros(2)}
    with pytest.raises(SyncError, match=r"unexpected \['model.extra.weight'\]"):
        apply_state_dict(dst, extra)
    assert_state_equal(snapshot(dst), before)


# -- checkpoints -----------------------------------------------------------------------------


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 40, (3, 8), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def _adamw(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.95), weight_decay=0.1)


def test_checkpoint_round_trip_restores_weights_and_optimizer(tokenizer, tmp_path):
    model = tiny(tokenizer, seed=0)
    opt = _adamw(model)
    for step in range(2):
        _train_step(model, opt, seed=step)
    root = tmp_path / "checkpoints"
    saved_state = TrainerState(
        step=2,
        version=2,
        offsets=[PartitionOffset("run.experiences", 0, 17)],
        seen=id_digest("g#0"),
        counters={"checkpoints": 1.0},
        duplicates_dropped=3,
        stale_dropped=4,
    )
    path = save_checkpoint(root, saved_state, model, opt, keep=3)
    assert path == root / "step_00000002"
    assert latest_checkpoint(root) == path
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))  # stored once
    assert STATE_DECODER.decode((path / "state.json").read_bytes()) == saved_state

    fresh = tiny(tokenizer, seed=5)
    fresh_opt = _adamw(fresh, lr=0.5)  # different hyper-parameter, restored from the checkpoint
    state = load_checkpoint(path, fresh, fresh_opt)
    assert state == saved_state
    assert_state_equal(snapshot(fresh), snapshot(model))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    assert tuple(fresh_opt.param_groups[0]["betas"]) == (0.8, 0.95)
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for pid in saved:
        assert saved[pid].keys() == loaded[pid].keys()
        for key in saved[pid]:
            assert torch.equal(torch.as_tensor(saved[pid][key]), torch.as_tensor(loaded[pid][key]))

    _train_step(model, opt, seed=2)
    _train_step(fresh, fresh_opt, seed=2)
    assert_state_equal(snapshot(fresh), snapshot(model))
    # and the third step did change the weights (the comparison is not of frozen models)
    again = tiny(tokenizer, seed=5)
    load_checkpoint(path, again, _adamw(again))
    assert not torch.equal(again.model.norm.weight, model.model.norm.weight)


def test_latest_checkpoint_moves_forward(tokenizer, tmp_path):
    model = tiny(tokenizer)
    opt = _adamw(model)
    assert latest_checkpoint(tmp_path / "none") is None
    _train_step(model, opt, 0)
    save_checkpoint(tmp_path, TrainerState(step=1), model, opt, keep=3)
    second = save_checkpoint(tmp_path, TrainerState(step=2), model, opt, keep=3)
    assert latest_checkpoint(tmp_path) == second
    assert not list(tmp_path.glob(".tmp_*"))  # the temporary folder was renamed away


def test_load_missing_checkpoint_raises_checkpoint_error(tokenizer, tmp_path):
    model = tiny(tokenizer)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "step_00000009", model, _adamw(model))


def test_corrupt_checkpoint_raises_checkpoint_error(tokenizer, tmp_path):
    model = tiny(tokenizer)
    opt = _adamw(model)
    _train_step(model, opt, 0)
    path = save_checkpoint(tmp_path, TrainerState(step=1), model, opt, keep=3)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError):
        load_checkpoint(path, model, opt)


def test_corrupt_optimizer_file_leaves_model_untouched(tokenizer, tmp_path):
    model = tiny(tokenizer)
    opt = _adamw(model)
    _train_step(model, opt, 0)
    path = save_checkpoint(tmp_path, TrainerState(step=1), model, opt, keep=3)
    (path / "optimizer.safetensors").write_bytes(b"\xff" * 64)
    fresh = tiny(tokenizer)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError):
        load_checkpoint(path, fresh, _adamw(fresh))
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, before[name]), name
