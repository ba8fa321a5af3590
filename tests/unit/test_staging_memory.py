"""The staging copy's memory (``sync/staging.py``): which memory ``synchronizer.staging``
gives on a CPU, one stage per slot at a time, buffers reused until a release keeps them, and
what a stage adopts without a copy."""

from __future__ import annotations

import pytest
import torch

from streamrft.schemas.errors import OutOfMemory
from streamrft.sync.staging import (
    DEVICE_HEADROOM,
    StageMemory,
    StagingArea,
    choose_memory,
    from_device_kind,
    out_of_memory,
    staging_memory,
)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_on_a_cpu_host_and_device_staging_are_host_memory_and_none_is_none():
    assert staging_memory("host", CPU, 1 << 30) == StageMemory(CPU)
    assert staging_memory("device", CPU, 1 << 40) == StageMemory(CPU)
    assert staging_memory("none", CPU, 1) is None
    assert not StageMemory(CPU).pinned


def test_a_version_read_from_a_device_is_staged_on_the_gpu_where_it_fits_whatever_staging_says():
    """The choice on a GPU box, by the free memory given (the GPU is not here): ``device``
    staging, and a version read from a device (``cuda_ipc``) with ``host`` staging too, on
    the model's GPU when a version fits with the headroom left, else pinned host memory;
    ``host`` otherwise pinned host memory; ``none`` nothing."""
    gpu, version = torch.device("cuda", 1), 10 << 20
    fits, short = version + DEVICE_HEADROOM, version + DEVICE_HEADROOM - 1
    pinned = StageMemory(CPU, pinned=True)
    assert choose_memory("device", gpu, version, fits) == StageMemory(gpu)
    assert choose_memory("device", gpu, version, short) == pinned
    assert choose_memory("host", gpu, version, fits) == pinned
    assert choose_memory("none", gpu, version, fits) is None
    for kind in ("host", "device"):  # a version on a device stays on one: never over the bus
        assert choose_memory(from_device_kind(kind), gpu, version, fits) == StageMemory(gpu)
        assert choose_memory(from_device_kind(kind), gpu, version, short) == pinned
    assert from_device_kind("none") == "none"  # received at the sync point, as it asks
    assert choose_memory(from_device_kind("host"), CPU, version, None) == StageMemory(CPU)


def test_a_stage_gives_tensors_in_the_memory_for_versions_read_from_a_device():
    """``like(..., stage.from_device)``: the receiver of a device's version asks for that
    memory (a "meta" device stands for the GPU here); a buffer of the same name in another
    memory is replaced, never handed out."""
    other = StageMemory(torch.device("meta"))
    area = StagingArea(StageMemory(CPU), other)
    stage = area.stage()
    assert stage.memory == StageMemory(CPU) and stage.from_device == other
    flat = {"image": torch.empty(64, dtype=torch.uint8)}
    assert stage.like(flat, stage.from_device)["image"].device.type == "meta"
    stage.release()
    again = area.stage()
    assert again.like(flat)["image"].device == CPU  # this slot's buffer was elsewhere
    again.release()
    assert StagingArea(StageMemory(CPU)).from_device == StageMemory(CPU)


def _like() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.bfloat16)}


def test_a_slot_is_lent_once_and_its_buffers_are_reused_after_the_release():
    area = StagingArea(StageMemory(CPU))
    stage = area.stage()
    with pytest.raises(RuntimeError, match="lent already"):
        area.stage()
    raw = stage.host_bytes(100)
    tensors = stage.like(_like())
    assert raw.dtype == torch.uint8 and raw.numel() == 100
    assert {n: (t.shape, t.dtype) for n, t in tensors.items()} == {
        n: (t.shape, t.dtype) for n, t in _like().items()
    }
    assert area.lent() == {"version"}
    stage.release()
    stage.release()  # twice is safe
    assert area.lent() == frozenset()
    again = area.stage()
    assert again.host_bytes(100).data_ptr() == raw.data_ptr()  # nothing allocated
    assert again.like(_like())["w"].data_ptr() == tensors["w"].data_ptr()
    assert again.host_bytes(64).data_ptr() != raw.data_ptr()  # another size: a new one
    again.release()


def test_a_release_that_keeps_the_tensors_gives_the_slot_new_memory():
    area = StagingArea(StageMemory(CPU))
    stage = area.stage()
    kept = stage.like(_like())["w"]
    stage.release(keep=True)  # e.g. the state an explorer holds to rebuild deltas on
    fresh = area.stage()
    assert fresh.like(_like())["w"].data_ptr() != kept.data_ptr()
    fresh.release()


def test_buffers_a_version_did_not_use_are_not_kept():
    area = StagingArea(StageMemory(CPU))
    stage = area.stage()
    old = stage.like({"gone": torch.zeros(1000)})["gone"]
    stage.release()
    stage = area.stage()
    stage.like({"w": torch.zeros(2)})
    stage.release()
    stage = area.stage()
    assert stage.like({"gone": torch.zeros(1000)})["gone"].data_ptr() != old.data_ptr()
    stage.release()


def test_adopt_keeps_tensors_in_its_memory_and_copies_a_receivers_reused_buffers():
    area = StagingArea(StageMemory(CPU))
    stage = area.stage()
    fresh = {"w": torch.randn(4, 3), "b": torch.randn(5).to(torch.bfloat16)}
    same = stage.adopt(fresh)
    assert all(same[n] is fresh[n] for n in fresh)  # host memory already: no copy
    copied = stage.adopt(fresh, copy=True)  # a receiver writes these again later
    assert all(copied[n].data_ptr() != fresh[n].data_ptr() for n in fresh)
    assert all(torch.equal(copied[n], fresh[n]) for n in fresh)
    fresh["w"].add_(1)
    assert not torch.equal(copied["w"], fresh["w"])
    stage.release()


def test_a_base_is_lent_with_its_version_and_released_with_it():
    area = StagingArea(StageMemory(CPU))
    stage = area.stage()
    base = stage.base()
    assert stage.base() is base
    base.host_bytes(10)
    assert area.lent() == {"version", "base"}
    stage.release()
    assert area.lent() == frozenset()


def test_memory_the_allocator_cannot_give_is_a_retriable_error_not_the_versions_fault():
    """A staging buffer the host cannot hold (the allocator's own failure: more bytes than
    any machine has) is :class:`OutOfMemory`, retriable, so the follower keeps its weights
    and tries again instead of rejecting the version; the stage stays usable."""
    area = StagingArea(StageMemory(CPU))
    stage = area.stage()
    with pytest.raises(OutOfMemory, match="no memory for a staging buffer") as raised:
        stage.host_bytes(1 << 55)
    assert raised.value.retriable
    huge = {"w": torch.empty(1 << 53, device="meta")}  # float32: 2**55 bytes
    with pytest.raises(OutOfMemory, match="no memory for a staging tensor"):
        stage.like(huge)
    assert stage.host_bytes(64).numel() == 64
    stage.release()
    assert area.lent() == frozenset()
    assert out_of_memory(MemoryError()) and out_of_memory(torch.OutOfMemoryError("CUDA oom"))
    assert out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not out_of_memory(RuntimeError("shapes differ")) and not out_of_memory(ValueError())
