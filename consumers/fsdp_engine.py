"""The ``fsdp2`` train engine: the policy sharded over ``trainer.nproc`` ranks with
``torch.distributed.fsdp.fully_shard`` (each decoder layer, then the root), data parallel.

It is the ``torch`` engine (:class:`~.train_engine.TorchTrainEngine`: same model, LoRA,
reference model, optimizer, algorithm step) with the model sharded after ``prepare``.
Rank 0 runs the :class:`~.trainer.Trainer`; its engine sends every other rank a command
(:mod:`.distributed`) before each collective, and the others follow in :meth:`follow`.

- **Step**: each rank trains its share of every micro-batch's rows, weighed so that the
  summed gradients are the single-process step's (:class:`~.distributed.RankShare`); with
  ``nproc`` ranks a micro-batch (``trainer.micro_batch_size``,
  ``trainer.max_tokens_per_micro_batch``) is split over them, so each rank runs about
  1/nproc of it.
- **Warm-up**: on rank 0 alone, before sharding; ``prepare`` then broadcasts rank 0's
  weights (and the LoRA adapter's initial values) to every rank.
- **Versions, evaluation, checkpoints**: rank 0 keeps an unsharded CPU replica of the
  model, refreshed from the shards by a gather (``get_model_state_dict`` with full state
  and CPU offload, a collective) when it is stale; versions are published and evaluations
  run from it. Checkpoints are gathered too (weights and AdamW state), in the ``torch``
  engine's format (optimizer state keyed by parameter index), so either engine resumes
  from the other's checkpoints, whatever ``nproc`` wrote them. The replica costs rank 0
  one full float32 copy of the model in host memory.
- **Teacher** (on-policy distillation, ``algorithm.teacher_path``): not sharded. Every rank
  loads the whole teacher from the folder when its engine is made and computes the
  teacher's log-probs of the whole batch itself, with no collective; it costs each rank
  one full copy of the teacher in the compute dtype.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from streamrft.consumers.checkpoint import load_checkpoint, save_checkpoint
from streamrft.consumers.distributed import (
    Command,
    Gather,
    Load,
    Prepare,
    RankShare,
    Save,
    Stop,
    TrainStep,
    join_group,
    last_barrier,
    receive_command,
    send_command,
)
from streamrft.consumers.state import TrainerState
from streamrft.consumers.train_engine import Evaluator, TorchTrainEngine
from streamrft.infra.config import Config
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ExperienceGroup
from streamrft.sync.payload import ModelWeights, Snapshot
from streamrft.sync.weights import apply_state_dict, shared_aliases

log = logging.getLogger(__name__)
GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def shard(model: torch.nn.Module) -> None:
    """``fully_shard`` each decoder layer (the model's ``_no_split_modules`` classes), then
    the root."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_types = set(getattr(inner, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module)
    fully_shard(model)


@torch.no_grad()
def broadcast_module(module: torch.nn.Module) -> None:
    """Every rank's ``module`` takes rank 0's parameters and buffers (tied ones once)."""
    aliases = shared_aliases(module)
    for name, tensor in module.state_dict().items():
        if name not in aliases:
            dist.broadcast(tensor, 0)


class IndexedOptimizerState:
    """Stands in for the optimizer where ``checkpoint.py`` saves or loads one: the state
    dict in the ``torch`` engine's layout (parameters by index, in optimizer order)."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.state = state or {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state

    @classmethod
    def of(cls, by_name: dict[str, Any]) -> IndexedOptimizerState:
        """From ``get_optimizer_state_dict``'s layout (parameters by name)."""
        names = [n for group in by_name["param_groups"] for n in group["params"]]
        index = {name: i for i, name in enumerate(names)}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
        return cls(
            {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}
        )

    def by_name(self, names: list[str]) -> dict[str, Any]:
        """In ``set_optimizer_state_dict``'s layout; ``names``: the parameters in order."""
        groups = [
            {**g, "params": [names[i] for i in g["params"]]} for g in self.state["param_groups"]
        ]
        return {
            "state": {names[i]: s for i, s in self.state["state"].items()},
            "param_groups": groups,
        }


class GatheredWeights(ModelWeights):
    """The weights a version publishes, taken from rank 0's replica after a gather."""

    def __init__(self, like: ModelWeights, replica: torch.nn.Module, gather) -> None:
        vars(self).update(vars(like))  # the torch engine's choices (LoRA, dtype...)
        self.model = replica
        self._gather = gather

    def snapshot(self, into: Snapshot | None = None) -> Snapshot:
        """Gathered first, on the trainer's turn (the ranks take commands one at a time)."""
        self._gather()
        return super().snapshot(into)

    def payload(
        self, version: int, step: int, must_be_full: bool = False, frozen: Snapshot | None = None
    ):
        if frozen is None:  # from the replica itself: gather it now
            self._gather()
        return super().payload(version, step, must_be_full, frozen)


class FsdpTrainEngine(TorchTrainEngine):
    """The ``torch`` engine sharded over ``trainer.nproc`` ranks (module docstring)."""

    def __init__(self, cfg: Config) -> None:
        if cfg.model.dtype == "float16" and cfg.trainer.world > 1:
            raise ConfigError(
                "trainer.nproc: the fsdp2 engine has no float16 loss scaling across ranks; "
                "use model.dtype bfloat16 or float32"
            )
        self.ranks = join_group(cfg.trainer.world, cfg.model.device)
        super().__init__(cfg)
        self.share = RankShare(self.ranks, self.algo.spec.loss_agg_mode)
        self.replica: torch.nn.Module | None = None  # rank 0, once prepared
        self._fresh = False  # the replica holds the current weights

    # -- rank 0: each call first tells the others ------------------------------------------
    def _command(self, command: Command) -> None:
        if self.ranks.leader:
            send_command(self.ranks, command)

    def prepare(self) -> ModelWeights:
        self._command(Prepare())
        weights = super().prepare()
        broadcast_module(self.model)
        if isinstance(self.ref_model, torch.nn.Module):  # a copy of the (warmed) model
            broadcast_module(self.ref_model)
            shard(self.ref_model)
        if self.ranks.leader:
            self.replica = copy.deepcopy(self.model).to("cpu").eval()
            self._fresh = True
        before = [p for p in self.model.parameters() if p.requires_grad]
        shard(self.model)
        after = [p for p in self.model.parameters() if p.requires_grad]
        sharded = {id(old): new for old, new in zip(before, after, strict=True)}
        for group in cast(torch.optim.Optimizer, self.optimizer).param_groups:  # no state yet
            group["params"] = [sharded[id(p)] for p in group["params"]]
        return GatheredWeights(weights, self.replica or self.model, self.gather)

    retries_steps = False  # every rank takes part in a step: a failure ends the group

    def train_step(self, groups: list[ExperienceGroup], version: int) -> dict[str, float]:
        self._command(TrainStep(version, groups, self.steps_trained))
        self._fresh = False
        return super().train_step(groups, version)

    def gather(self) -> None:
        """Refresh rank 0's replica from the shards (a collective) unless it is current."""
        if self.ranks.leader and self._fresh:
            return
        self._command(Gather())
        full = get_model_state_dict(self.model, options=GATHERED)
        if self.replica is not None:
            apply_state_dict(self.replica, full)
            self._fresh = True

    def evaluate(self, evaluate: Evaluator) -> dict[str, float]:
        self.gather()
        return evaluate(cast(torch.nn.Module, self.replica), self.tokenizer)

    def save(self, state: TrainerState) -> Path:
        self._command(Save())
        full = get_model_state_dict(self.model, options=GATHERED)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=GATHERED)
        if self.replica is None:  # not rank 0
            return self.ckpt_root
        apply_state_dict(self.replica, full)
        self._fresh = True
        opt = cast(torch.optim.Optimizer, IndexedOptimizerState.of(optim))
        return save_checkpoint(self.ckpt_root, state, self.replica, opt, self.tcfg.keep_checkpoints)

    def load(self, path: Path | None) -> TrainerState:
        """Rank 0 reads ``path`` (any engine's checkpoint) into its replica, then every rank
        takes its shards of the weights and optimizer state from it."""
        self._command(Load())
        state, full, optim = TrainerState(step=0), {}, {}
        if self.replica is not None and path is not None:
            saved = IndexedOptimizerState()
            state = load_checkpoint(path, self.replica, cast(torch.optim.Optimizer, saved))
            full, optim = self.replica.state_dict(), saved.by_name(self._param_names())
        set_model_state_dict(self.model, full, options=FROM_RANK0)
        set_optimizer_state_dict(self.model, self.optimizer, optim, options=FROM_RANK0)
        self._fresh = self.replica is not None
        self.steps_trained = state.step  # rank 0's; the others take it from each TrainStep
        return state

    def _param_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def release(self) -> None:
        """Rank 0, after the trainer finished: the other ranks stop (all meet once more, so
        that no rank tears its connections down while another still uses them)."""
        self._command(Stop())
        last_barrier(self.ranks)

    # -- the other ranks ---------------------------------------------------------------------
    def follow(self) -> None:
        """Carry out rank 0's commands until it says stop."""
        while True:
            match receive_command(self.ranks):
                case Prepare():
                    self.prepare()
                case TrainStep(version=version, groups=groups, step=step):
                    self.steps_trained = step
                    self.train_step(groups, version)
                case Gather():
                    self.gather()
                case Save():
                    self.save(TrainerState(step=0))
                case Load():
                    self.load(None)
                case Stop():
                    last_barrier(self.ranks)
                    return
