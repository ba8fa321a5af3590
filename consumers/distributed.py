"""The trainer's ranks: their process group, the commands rank 0 sends, the rows each trains.

A trainer of ``trainer.nproc`` ranks (``app/launch.py`` starts them with torchrun's
environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
is one :class:`~.trainer.Trainer` on rank 0 and followers on the others. Rank 0 alone
reads the experiences topic, publishes, checkpoints and commits offsets; whenever its
engine needs the others (a step, a gather of the full weights, a save, a load), it
broadcasts a :data:`Command` first: msgspec msgpack (the groups of a step in their wire
encoding, no pickle), sent as a length and a ``uint8`` tensor.

Data parallel step: every rank collates the whole batch (advantages need whole groups)
and, of each micro-batch the single-process step would run, trains its contiguous share
of the rows (:class:`RankShare`). Its loss is weighed by the share of the batch's
normaliser that its rows hold (``consumers/algorithms/aggregation.py`` ``normaliser``:
trained tokens for ``token-mean``, sequences with a trained token for the ``seq-mean-*``
modes), so the gradients summed over the ranks are the single-process step's, which are
the whole batch's in one piece.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from streamrft.consumers.algorithms.aggregation import normaliser
from streamrft.consumers.algorithms.step import BatchShare, Mismatch
from streamrft.consumers.batching import PolicyBatch
from streamrft.infra.modeling import resolve_device
from streamrft.infra.net import free_port
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ExperienceGroup

COMMAND_TIMEOUT = timedelta(hours=6)
"""Longest a rank waits in one collective: followers wait for rank 0's next command
while it collects a batch or warms up. A rank that dies is noticed by the launcher,
which stops the others at once; this bounds only a group that hangs with all alive."""


# -- the process group -----------------------------------------------------------------------
@dataclass(frozen=True)
class Ranks:
    """This process's place in the trainer's process group."""

    rank: int
    world: int
    device: torch.device
    """Where collectives of this group put their tensors (CPU for gloo, this rank's GPU
    for nccl)."""

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join_group(world: int, device: str = "cpu") -> Ranks:
    """Join (once per process) the default process group of ``world`` ranks (``trainer.nproc``
    on each of ``trainer.nnodes`` hosts): gloo when
    ``device`` (``model.device``) is the CPU, nccl on GPUs, where rank r uses
    ``cuda:LOCAL_RANK`` (so ``model.device`` must be ``cuda`` or ``auto``, not one GPU).
    A process started without a launcher's environment makes a group of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    started = int(os.environ["WORLD_SIZE"])
    if started != world:
        raise ConfigError(
            f"trainer.nproc x trainer.nnodes: {world} ranks, but this rank was started in a "
            f"group of WORLD_SIZE={started}"
        )
    cuda = resolve_device(device).type == "cuda"
    if cuda and ":" in device and world > 1:
        raise ConfigError(
            f"model.device: {device!r} names one GPU; with {world} trainer ranks use cuda or "
            "auto (a host's local rank r trains on cuda:r)"
        )
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=COMMAND_TIMEOUT)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Ranks(dist.get_rank(), dist.get_world_size(), device)


LAST_BARRIER_S = 120.0
"""How long the ranks wait for each other after rank 0's Stop."""


def last_barrier(ranks: Ranks) -> None:
    """Every rank meets here after the Stop (gloo: a barrier that names a rank that does not
    come within :data:`LAST_BARRIER_S`, rather than waiting out the group's timeout)."""
    if ranks.world == 1:
        return
    if ranks.device.type == "cpu":
        dist.monitored_barrier(timeout=timedelta(seconds=LAST_BARRIER_S))
    else:
        dist.barrier()


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# -- commands --------------------------------------------------------------------------------
class Prepare(msgspec.Struct, tag="prepare", frozen=True):
    """Attach the adapter, take rank 0's weights, shard, make the optimizer."""


class TrainStep(msgspec.Struct, tag="train_step", frozen=True):
    """One step on ``groups`` (the whole batch; each rank trains its rows)."""

    version: int
    groups: list[ExperienceGroup]
    step: int = 0
    """Rank 0's :attr:`~.train_engine.TorchTrainEngine.steps_trained`: the lr schedule's step."""


class Gather(msgspec.Struct, tag="gather", frozen=True):
    """Gather the full weights on rank 0 (to publish or evaluate them)."""


class Save(msgspec.Struct, tag="save", frozen=True):
    """Gather the full weights and optimizer state on rank 0, which writes a checkpoint."""


class Load(msgspec.Struct, tag="load", frozen=True):
    """Take the weights and optimizer state rank 0 read from a checkpoint."""


class Stop(msgspec.Struct, tag="stop", frozen=True):
    """The trainer finished: leave the group and exit."""


Command = Prepare | TrainStep | Gather | Save | Load | Stop
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Command)


def send_command(ranks: Ranks, command: Command) -> None:
    """Rank 0: broadcast ``command`` to every rank (a no-op in a group of one)."""
    if ranks.world == 1:
        return
    data = _ENCODER.encode(command)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=ranks.device), 0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(ranks.device)
    dist.broadcast(buf, 0)


def receive_command(ranks: Ranks) -> Command:
    """Other ranks: the next command rank 0 broadcasts."""
    size = torch.zeros(1, dtype=torch.int64, device=ranks.device)
    dist.broadcast(size, 0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=ranks.device)
    dist.broadcast(buf, 0)
    return _DECODER.decode(buf.cpu().numpy().tobytes())


# -- data parallel rows ----------------------------------------------------------------------
class RankShare(BatchShare):
    """This rank's rows of each micro-batch and their weight (see the module docstring).

    The weight carries a factor ``world``: FSDP averages gradients over the ranks, the
    step needs their sum. A rank whose share of a micro-batch is empty still runs one
    row (every rank must run the same forwards and backwards) with weight 0.
    """

    def __init__(self, ranks: Ranks, loss_agg_mode: str) -> None:
        super().__init__(loss_agg_mode)
        self.ranks = ranks

    def rows(self, batch: PolicyBatch, lo: int, hi: int) -> tuple[int, int, float, float]:
        r, w = self.ranks.rank, self.ranks.world
        start, end = lo + (hi - lo) * r // w, lo + (hi - lo) * (r + 1) // w
        if start == end:
            return lo, lo + 1, 0.0, 1.0
        mine = normaliser(batch.response_mask[start:end], self.mode)
        return start, end, w * mine, self.whole(batch)

    def combine(
        self, stats: dict[str, float], drift: float, mismatch: Mismatch
    ) -> tuple[dict[str, float], float]:
        """Sums of the weighted statistics (over ``world``: the weights carry it) and of
        the mismatch totals, maxima of the drift and mismatch; ``mismatch`` is updated."""
        keys = sorted(stats)
        device = self.ranks.device
        sums = torch.tensor(
            [*(stats[k] for k in keys), mismatch.total, mismatch.tokens],
            dtype=torch.float64,
            device=device,
        )
        maxima = torch.tensor([drift, mismatch.largest], dtype=torch.float64, device=device)
        dist.all_reduce(sums, dist.ReduceOp.SUM)
        dist.all_reduce(maxima, dist.ReduceOp.MAX)
        totals, most = sums.tolist(), maxima.tolist()
        mismatch.total, mismatch.tokens, mismatch.largest = totals[-2], totals[-1], most[1]
        return {k: v / self.ranks.world for k, v in zip(keys, totals, strict=False)}, most[0]
