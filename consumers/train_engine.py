"""Train engines: what owns the policy being trained, behind one interface.

The trainer's loop (:mod:`.trainer`) never touches a model or an optimizer. It asks its
engine to warm up, to prepare for RL, to take one step on a batch of groups, to save and
load checkpoints, and for the weights to publish (:class:`~streamrft.sync.payload.ModelWeights`,
which a transport sends). Today's engine, ``torch``, trains one model in one process in
float32; a sharded engine (FSDP2) or another precision scheme is a second engine, not a
fork of the loop: a class here and a line in :data:`TRAIN_ENGINES`.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamrft.consumers.algorithms import policy_step, resolve_algorithm
from streamrft.consumers.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from streamrft.consumers.state import TrainerState
from streamrft.consumers.warmup import sft_warmup
from streamrft.infra.config import Config
from streamrft.infra.modeling import load_policy
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.experience import ExperienceGroup, Task
from streamrft.sync.payload import ModelWeights

Evaluator = Callable[[torch.nn.Module, Any], dict[str, float]]
"""``evaluate(model, tokenizer) -> {"eval/accuracy": ...}``: handed to the trainer by the
application layer (``producers.evaluation.GreedyEvaluator``)."""


class TrainEngine(abc.ABC):
    """The policy being trained: model, optimizer, precision, reference model."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids of an experience must lie below this."""

    @abc.abstractmethod
    def warmup(self, tasks: list[Task]) -> list[float]:
        """Supervised warm-up steps on (prompt, answer) pairs; the loss of each step."""

    @abc.abstractmethod
    def prepare(self) -> ModelWeights:
        """After the warm-up: the LoRA adapter, optimizer and reference model. Returns the
        weights a transport publishes from."""

    @abc.abstractmethod
    def train_step(self, groups: list[ExperienceGroup], version: int) -> dict[str, float]:
        """One optimisation step on a batch of groups with the model at ``version``; its
        metrics (``train/...``)."""

    @abc.abstractmethod
    def evaluate(self, evaluate: Evaluator) -> dict[str, float]:
        """``evaluate`` applied to the current weights."""

    @abc.abstractmethod
    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run, if any."""

    @abc.abstractmethod
    def save(self, state: TrainerState) -> Path:
        """A checkpoint of the weights, optimizer and ``state``; old ones pruned."""

    @abc.abstractmethod
    def load(self, path: Path) -> TrainerState:
        """Restore weights and optimizer from a checkpoint; returns the rest of the state."""


class TorchTrainEngine(TrainEngine):
    """One model in this process: float32, AdamW with grad clipping, the configured
    algorithm (``trainer.algorithm``), optional LoRA (the adapter alone is trained)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        resolve_algorithm(cfg.trainer)  # a bad name fails at start-up, naming the field
        torch.manual_seed(cfg.run.seed)
        self.model, self.tokenizer = load_policy(cfg.model)
        self.optimizer: torch.optim.Optimizer | None = None  # made once the model is final
        self.ref_model: Any = None
        self.ckpt_root = cfg.run_dir / "checkpoints"

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    def warmup(self, tasks: list[Task]) -> list[float]:
        t = self.tcfg
        return sft_warmup(
            self.model,
            self.tokenizer,
            tasks,
            t.warmup_sft_steps,
            t.warmup_sft_batch,
            t.warmup_sft_lr,
            self.cfg.run.seed,
        )

    def prepare(self) -> ModelWeights:
        lora = self.cfg.model.lora.enabled
        if lora:
            from streamrft.sync.lora import BaseModelView, attach_lora

            self.model = attach_lora(self.model, self.cfg.model.lora)
            if self.tcfg.kl_coef > 0:  # the base with the adapter off, no second copy
                self.ref_model = BaseModelView(self.model)
        elif self.tcfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.tcfg.lr,
            weight_decay=self.tcfg.weight_decay,
            betas=self.tcfg.betas,
        )
        return ModelWeights(self.model, lora)

    def train_step(self, groups: list[ExperienceGroup], version: int) -> dict[str, float]:
        assert self.optimizer is not None, "prepare() first"
        return policy_step(
            self.model,
            self.optimizer,
            groups,
            self.tcfg,
            self.tokenizer.pad_token_id,
            self.cfg.explorer.temperature,
            self.ref_model,
            version,
        )

    def evaluate(self, evaluate: Evaluator) -> dict[str, float]:
        return evaluate(self.model, self.tokenizer)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.ckpt_root)

    def save(self, state: TrainerState) -> Path:
        assert self.optimizer is not None, "prepare() first"
        return save_checkpoint(
            self.ckpt_root, state, self.model, self.optimizer, self.tcfg.keep_checkpoints
        )

    def load(self, path: Path) -> TrainerState:
        assert self.optimizer is not None, "prepare() first"
        return load_checkpoint(path, self.model, self.optimizer)


TRAIN_ENGINES: dict[str, Callable[[Config], TrainEngine]] = {"torch": TorchTrainEngine}
"""``trainer.engine`` -> the engine class."""


def check_train_engine(name: str) -> Callable[[Config], TrainEngine]:
    """The engine registered as ``name``; a :class:`ConfigError` naming the field if none."""
    if name not in TRAIN_ENGINES:
        raise ConfigError(
            f"trainer.engine: unknown engine {name!r}; known: {', '.join(TRAIN_ENGINES)}"
        )
    return TRAIN_ENGINES[name]


def make_train_engine(cfg: Config) -> TrainEngine:
    return check_train_engine(cfg.trainer.engine)(cfg)
