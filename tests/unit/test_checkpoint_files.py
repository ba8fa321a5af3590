"""Trainer checkpoints on disk: crash safety, fsync, retention, the older layout, the dedup
window through a real save and load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from streamrft.consumers import checkpoint
from streamrft.consumers.buffer import ExperienceBuffer
from streamrft.consumers.checkpoint import KEEP_MARKER, load_checkpoint, save_checkpoint
from streamrft.consumers.checkpoint_folders import latest_checkpoint
from streamrft.consumers.state import TrainerState, from_legacy, id_digest
from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model
from streamrft.schemas import ExperienceGroup
from streamrft.sync.weights import unique_state_dict
from tests.helpers.groups import make_group

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

P0 = ("run.experiences", 0)
P1 = ("run.experiences", 1)


def group(gid: str, exp_ids: list[str] | None = None) -> ExperienceGroup:
    """A group whose id is ``gid`` (experience ids ``<gid>#<i>``), as the buffer tests make."""
    return make_group("run", gid, 0, 2, group_id=gid, exp_ids=exp_ids)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def tiny(tokenizer, seed: int = 0) -> torch.nn.Module:
    cfg = ModelConfig(
        hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_positions=16, seed=seed
    )
    return build_tiny_model(cfg, tokenizer)


def trained(tokenizer, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny(tokenizer, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(4, 30, (2, 6), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in unique_state_dict(model).items()}


def steps_on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "latest")


# -- atomic and durable ----------------------------------------------------------------------


def test_a_crash_while_saving_the_latest_step_again_keeps_it(tokenizer, tmp_path, monkeypatch):
    first_model, first_opt = trained(tokenizer, seed=1)
    first = TrainerState(step=5, version=5, duplicates_dropped=1)
    path = save_checkpoint(tmp_path, first, first_model, first_opt, keep=3)
    assert latest_checkpoint(tmp_path) == path

    real_replace = os.replace

    def crash_on_rename_into_place(src, dst):
        if Path(dst) == path:  # the process dies as the new folder is renamed into place
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_rename_into_place)
    second_model, second_opt = trained(tokenizer, seed=2)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, TrainerState(step=5, version=6), second_model, second_opt, 3)
    monkeypatch.setattr(os, "replace", real_replace)

    # what latest names is still there (set aside) and loads: the first save, whole
    found = latest_checkpoint(tmp_path)
    assert found is not None
    model = tiny(tokenizer, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    assert load_checkpoint(found, model, opt) == first
    for name, tensor in weights(model).items():
        assert torch.equal(tensor, weights(first_model)[name]), name

    # the next save puts the step back in place and removes what was set aside
    again = save_checkpoint(tmp_path, TrainerState(step=5, version=6), second_model, second_opt, 3)
    assert again == path and latest_checkpoint(tmp_path) == path
    assert steps_on_disk(tmp_path) == ["step_00000005"]
    assert load_checkpoint(path, model, opt).version == 6


def test_every_file_the_folder_and_latest_reach_the_disk(tokenizer, tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    model, opt = trained(tokenizer)
    path = save_checkpoint(tmp_path, TrainerState(step=1), model, opt, keep=3)
    tmp = str(tmp_path / ".tmp_step_00000001")
    files = ["model.safetensors", "optimizer.safetensors", "optimizer.json", "state.json"]
    assert {f"{tmp}/{name}" for name in files} <= set(synced)
    assert sorted(os.listdir(path)) == sorted(files)  # nothing written that was not synced
    # the folder before its rename, the parent after it, the marker before its rename
    assert synced.index(tmp) > max(synced.index(f"{tmp}/{name}") for name in files)
    assert str(tmp_path / f".latest.tmp-{os.getpid()}") in synced
    assert synced[-1] == str(tmp_path)  # the parent, after latest was replaced


# -- retention -------------------------------------------------------------------------------


def test_only_the_newest_checkpoints_and_marked_ones_are_kept(tokenizer, tmp_path):
    model, opt = trained(tokenizer)
    for step in range(1, 4):
        save_checkpoint(tmp_path, TrainerState(step=step), model, opt, keep=2)
    assert steps_on_disk(tmp_path) == ["step_00000002", "step_00000003"]
    (tmp_path / "step_00000002" / KEEP_MARKER).touch()
    (tmp_path / ".tmp_step_00000009").mkdir()  # left by a save that crashed half-way
    for step in range(4, 7):
        save_checkpoint(tmp_path, TrainerState(step=step), model, opt, keep=2)
    assert steps_on_disk(tmp_path) == ["step_00000002", "step_00000005", "step_00000006"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000006"
    # saving the marked step again keeps its mark
    save_checkpoint(tmp_path, TrainerState(step=2), model, opt, keep=2)
    assert (tmp_path / "step_00000002" / KEEP_MARKER).is_file()


def test_keep_zero_keeps_every_checkpoint(tokenizer, tmp_path):
    model, opt = trained(tokenizer)
    for step in range(1, 6):
        save_checkpoint(tmp_path, TrainerState(step=step), model, opt, keep=0)
    assert steps_on_disk(tmp_path) == [f"step_{s:08d}" for s in range(1, 6)]


def test_checkpoints_of_later_steps_are_not_deleted(tokenizer, tmp_path):
    """A run restarted without resuming in the same folder leaves the old run's later
    steps alone (the retention counts back from the step just saved)."""
    model, opt = trained(tokenizer)
    save_checkpoint(tmp_path, TrainerState(step=50), model, opt, keep=1)
    save_checkpoint(tmp_path, TrainerState(step=1), model, opt, keep=1)
    save_checkpoint(tmp_path, TrainerState(step=2), model, opt, keep=1)
    assert steps_on_disk(tmp_path) == ["step_00000002", "step_00000050"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"


# -- the layout before TrainerState ----------------------------------------------------------

OLD_STATE = {
    "version": 9,
    "offsets": [["run.experiences", 0, 17], ["run.experiences", 1, 4]],
    "seen": ["g1#0", "g1#1", "g2#0", "g2#1"],
    "counters": {"checkpoints": 2, "publish_seconds": 1.5},
    "duplicates_dropped": 3,
    "stale_dropped": 1,
}
"""The ``state`` dict the trainer handed to ``save_checkpoint`` before TrainerState."""


def save_old_layout(root: Path, step: int, model, opt) -> Path:
    """What ``save_checkpoint`` wrote before TrainerState (that version's code, abridged)."""
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    save_file(unique_state_dict(model), str(folder / "model.safetensors"))
    tensors, meta = checkpoint._optimizer_split(opt)
    save_file(tensors, str(folder / "optimizer.safetensors"))
    (folder / "state.json").write_text(json.dumps({**OLD_STATE, "step": step, "optimizer": meta}))
    (root / "latest").write_text(folder.name)
    return folder


def test_from_legacy_converts_the_old_dict():
    state = from_legacy({**OLD_STATE, "step": 12, "optimizer": {"param_groups": []}})
    assert state.step == 12 and state.version == 9
    assert state.resume_offsets() == {P0: 17, P1: 4}
    assert state.seen == b"".join(id_digest(i) for i in OLD_STATE["seen"])
    assert state.counters == {"checkpoints": 2, "publish_seconds": 1.5}
    assert (state.duplicates_dropped, state.stale_dropped) == (3, 1)
    assert from_legacy({"step": 3}) == TrainerState(step=3)  # saved with no extra state


def test_a_checkpoint_of_the_older_layout_still_loads(tokenizer, tmp_path):
    model, opt = trained(tokenizer, seed=4)
    save_old_layout(tmp_path, 12, model, opt)
    path = latest_checkpoint(tmp_path)
    assert path == tmp_path / "step_00000012"
    fresh = tiny(tokenizer, seed=7)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    state = load_checkpoint(path, fresh, fresh_opt)
    assert state == from_legacy({**OLD_STATE, "step": 12})
    for name, tensor in weights(fresh).items():
        assert torch.equal(tensor, weights(model)[name]), name
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    # the old seen ids still catch duplicates
    buffer = ExperienceBuffer(max_staleness=1, dedup_window=100)
    buffer.restore(state)
    assert buffer.offer(group("g2"), P0, 17) is False
    assert buffer.offer(group("g3"), P0, 18) is True
    # and the next save writes the new layout beside it
    path2 = save_checkpoint(
        tmp_path, buffer.state(step=13, version=10, counters=state.counters), fresh, fresh_opt, 3
    )
    assert load_checkpoint(path2, fresh, fresh_opt).step == 13


# -- the dedup window through a real checkpoint ----------------------------------------------


def test_duplicates_are_caught_across_a_save_and_load(tokenizer, tmp_path):
    model, opt = trained(tokenizer)
    buffer = ExperienceBuffer(max_staleness=1, dedup_window=1000)
    for offset in range(6):
        buffer.offer(group(f"g{offset}"), P0, offset)
    buffer.take(4)  # g4 and g5 are still buffered at the checkpoint
    state = buffer.state(step=1, version=1, counters={"experiences_consumed": 12})
    path = save_checkpoint(tmp_path, state, model, opt, keep=3)

    loaded = load_checkpoint(path, model, opt)
    assert loaded == state
    resumed = ExperienceBuffer(max_staleness=1, dedup_window=1000)
    resumed.offer(group("before"), P1, 0)  # restored in place: what it held is replaced
    resumed.restore(loaded)
    assert resumed.resume_offsets() == {P0: 4}
    assert resumed.offer(group("g4"), P0, 4) is True  # read again from the resume offset
    assert resumed.offer(group("g5"), P0, 5) is True
    for trained_id in ("g0", "g3"):  # a copy of a trained group, published again later
        assert resumed.offer(group(trained_id), P0, 6) is False
    assert resumed.offer(group("g6", exp_ids=["g6#0", "g4#1"]), P1, 0) is False
    assert resumed.duplicates_dropped == 3
    assert [g.id for g in resumed.take(2)] == ["g4", "g5"]


def test_a_full_disk_is_a_clear_error_and_leaves_no_half_checkpoint(tokenizer, tmp_path):
    """On a real full device (a 16 KiB tmpfs; root only, else skipped)."""
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        model, opt = trained(tokenizer, seed=1)
        with pytest.raises(checkpoint.CheckpointError, match=r"no space left on the device of"):
            save_checkpoint(small, TrainerState(step=3, version=3), model, opt, keep=3)
        assert list(small.iterdir()) == []  # the half-written folder is gone, nothing named
        assert latest_checkpoint(small) is None
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
