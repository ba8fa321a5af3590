"""Train engines: what owns the policy being trained, behind one interface.

The trainer's loop (:mod:`.trainer`) never touches a model or an optimizer. It asks its
engine to warm up, to prepare for RL, to take one step on a batch of groups, to save and
load checkpoints, and for the weights to publish (:class:`~streamrft.sync.payload.ModelWeights`,
which a transport sends). Today's engine, ``torch``, trains one model in one process on
``model.device`` (float32 master weights, compute in ``model.dtype``: :mod:`.precision`);
a sharded engine (FSDP2) is a second engine, not a fork of the loop: a class and a line in
:data:`TRAIN_ENGINES`.
"""

from __future__ import annotations

import abc
import copy
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from streamrft.consumers.algorithms import policy_step, resolve_algorithm
from streamrft.consumers.algorithms.dpo import dpo_step
from streamrft.consumers.algorithms.step import BatchShare, mini_batches
from streamrft.consumers.checkpoint import Extras, load_checkpoint, save_checkpoint
from streamrft.consumers.checkpoint_folders import latest_checkpoint
from streamrft.consumers.critic import Critic, ValueModel
from streamrft.consumers.lr_schedule import lr_factor, set_lr
from streamrft.consumers.precision import Precision
from streamrft.consumers.state import TrainerState
from streamrft.consumers.step_undo import StepUndo, forget_unscale, needs_undo
from streamrft.consumers.teacher import load_teacher
from streamrft.consumers.throughput import peak_tflops, step_flops, throughput_metrics
from streamrft.consumers.warmup import sft_warmup
from streamrft.infra.config import Config
from streamrft.infra.modeling import DTYPES, load_policy, resolve_device
from streamrft.infra.prompts import PromptRenderer
from streamrft.schemas.errors import ConfigError, StepNotUndone
from streamrft.schemas.experience import ExperienceGroup, Task
from streamrft.sync.payload import DeltaPolicy, ModelWeights

log = logging.getLogger(__name__)

Evaluator = Callable[[torch.nn.Module, Any], dict[str, float]]
"""``evaluate(model, tokenizer) -> {"eval/accuracy": ...}``: handed to the trainer by the
application layer (``producers.evaluation.GreedyEvaluator``)."""


class TrainEngine(abc.ABC):
    """The policy being trained: model, optimizer, precision, reference model, and the
    teacher of on-policy distillation."""

    tokenizer: Any
    """The policy's tokenizer (the expert data and the evaluator render prompts with it)."""

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
        metrics (``train/...``). A step that raises has changed nothing the next step
        sees (:mod:`.step_undo`), or raises
        :class:`~streamrft.schemas.errors.StepNotUndone`."""

    @property
    def context_length(self) -> int:
        """The model's positions (``max_position_embeddings``; 0: unknown): an experience
        longer than this cannot be trained."""
        return 0

    retries_steps = False
    """Whether :meth:`retry_row_by_row` may follow a failed :meth:`train_step` in this
    process (not when other ranks take part in every step)."""
    steps_not_copied = 0
    """Steps of several updates this process trained without the copy that undoes them
    (host memory could not hold it: :mod:`.step_undo`)."""

    def retry_row_by_row(self, groups: list[ExperienceGroup], version: int) -> dict[str, float]:
        """After a step that raised (out of memory), which left the model and optimizer as
        they were before it: the same step again, one row per micro-batch."""
        raise NotImplementedError

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
    """One model in this process on ``model.device``: float32 master weights and AdamW
    state, forward/backward in ``model.dtype`` (autocast), grad clipping, optional gradient
    checkpointing, the configured algorithm (``algorithm.*``), optional LoRA (the
    adapter alone is trained). Under on-policy distillation the teacher
    (``algorithm.teacher_path``) is loaded when the engine is made, before any warm-up,
    so a missing folder or another vocabulary fails at start-up: frozen, in eval mode,
    its parameters in the compute dtype (as the reference model's)."""

    share: BatchShare | None = None
    """The rows of each step this process trains (None: all; ``fsdp2`` sets its own)."""
    steps_trained = 0
    """RL steps this engine's model has taken in the run (restored by :meth:`load`): the
    learning-rate schedule's step (``trainer.lr_schedule``)."""
    updates_applied = 0
    """Optimizer updates (the policy's and the critic's) the step under way has begun."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.algo = resolve_algorithm(cfg)  # a bad name fails at start-up, naming the field
        torch.manual_seed(cfg.run.seed)
        self.model, self.tokenizer = load_policy(cfg.model, dtype=torch.float32)
        self.params = sum(p.numel() for p in self.model.parameters())
        """The policy's parameters, before any adapter or sharding (the FLOPs estimate)."""
        self.precision = Precision.of(resolve_device(cfg.model.device), DTYPES[cfg.model.dtype])
        peak = peak_tflops(self.precision.device, self.tcfg.peak_tflops)
        self.peak_tflops = None if peak is None else peak * self.tcfg.world
        """Of every rank together (the MFU's denominator); None: no MFU reported."""
        if self.precision.device.type == "cuda" and self.tcfg.gpu_memory_fraction > 0:
            torch.cuda.set_per_process_memory_fraction(
                self.tcfg.gpu_memory_fraction, self.precision.device
            )
        self.optimizer: torch.optim.Optimizer | None = None  # made once the model is final
        self.ref_model: Any = None
        self.teacher: torch.nn.Module | None = None
        self.critic: Critic | None = None  # PPO's value model (``gae``), made in prepare()
        if self.algo.spec.needs_teacher:
            self.teacher = load_teacher(
                self.algo.spec.teacher_path, self.tokenizer, cfg.model, self.precision.dtype
            )
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
            PromptRenderer.from_config(self.cfg.taskset, self.tokenizer),
        )

    def prepare(self) -> ModelWeights:
        lora = self.cfg.model.lora.enabled
        if self.algo.spec.needs_critic:  # from the warmed policy, before any LoRA adapter
            spec = self.algo.spec
            self.critic = Critic(
                ValueModel.from_policy(self.model),
                self.tcfg,
                spec.critic_lr,
                spec.value_clip,
                self.precision,
            )
        if lora:
            from streamrft.sync.lora import BaseModelView, attach_lora

            self.model = attach_lora(self.model, self.cfg.model.lora)
            if self.algo.spec.needs_reference:  # the base with the adapter off, no second copy
                self.ref_model = BaseModelView(self.model)
        elif self.algo.spec.needs_reference:  # frozen: kept in the compute dtype
            self.ref_model = copy.deepcopy(self.model).to(self.precision.dtype).eval()
        if self.tcfg.gradient_checkpointing:
            enable_checkpointing(self.model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.tcfg.lr,
            weight_decay=self.tcfg.weight_decay,
            betas=self.tcfg.betas,
        )
        for optimizer in self._optimizers():  # counted before it changes anything
            optimizer.register_step_pre_hook(self._count_update)
        delta = DeltaPolicy.from_config(self.cfg.synchronizer, lora, self.cfg.model.dtype)
        return ModelWeights(self.model, lora, DTYPES[self.cfg.model.dtype], delta=delta)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The policy's optimizer, then the critic's."""
        assert self.optimizer is not None, "prepare() first"
        return [self.optimizer, *([self.critic.optimizer] if self.critic is not None else [])]

    def _scalers(self) -> list[Any | None]:
        """The float16 loss scalers of the policy and the critic (None: no scaling)."""
        scalers = [self.precision.scaler]
        if self.critic is not None:
            scalers.append(self.critic.precision.scaler)
        return scalers

    def _count_update(self, *_: object) -> None:
        self.updates_applied += 1

    def updates_per_step(self, groups: list[ExperienceGroup]) -> int:
        """Optimizer updates a step on ``groups`` makes: ``trainer.ppo_epochs`` passes of
        one per mini-batch (DPO: one per pass), and the critic's passes after them."""
        epochs = self.tcfg.ppo_epochs
        if self.algo.spec.pairs:
            return epochs
        minis = mini_batches([len(g.experiences) for g in groups], self.tcfg.mini_batch_size)
        return epochs * len(minis) + (epochs if self.critic is not None else 0)

    def train_step(self, groups: list[ExperienceGroup], version: int) -> dict[str, float]:
        """A step that fails leaves the engine as it was before it (a step of several
        updates is copied first: :mod:`.step_undo`), or, when an update of a step that
        was not copied was applied, raises :class:`StepNotUndone`."""
        self.updates_applied = 0
        if not self.retries_steps:  # a failure ends every rank's process: nothing to keep
            return self._timed_step(groups, version)
        undo = self._copy() if needs_undo(self.updates_per_step(groups)) else None
        steps = self.steps_trained
        try:
            return self._timed_step(groups, version)
        except Exception as exc:
            self._after_failure(undo, exc)
            self.steps_trained = steps
            raise

    def _copy(self) -> StepUndo | None:
        """The copy a step of several updates is undone from; None when host memory cannot
        hold it: the step goes on uncopied (a failure after one of its updates then raises
        :class:`StepNotUndone`, as for a step of one update), rather than the copy's
        failure being taken for the batch's."""
        try:
            return StepUndo(self._optimizers(), self._scalers())
        except (MemoryError, RuntimeError) as exc:  # torch's out-of-memory is a RuntimeError
            self.steps_not_copied += 1
            if self.steps_not_copied == 1:
                log.warning(
                    "trainer: no host memory for the copy a step of several updates is undone "
                    "from (%r); such steps go on without it (counted: steps_not_copied), and "
                    "one that fails after an update ends the trainer, which resumes from its "
                    "checkpoint",
                    exc,
                )
            return None

    def _after_failure(self, undo: StepUndo | None, exc: Exception) -> None:
        """Put the state from before the failed step back (``undo``); nothing to put back
        when no update began; :class:`StepNotUndone` when one did and nothing was copied."""
        applied = self.updates_applied
        if undo is not None:
            undo.restore()
            log.warning(
                "trainer: the failed step (%d update(s) applied) was undone: model, "
                "optimizer and loss scales are as before it",
                applied,
            )
        elif applied:
            raise StepNotUndone(
                f"a training step failed ({exc!r}) after its optimizer update was applied; "
                "the trainer exits so that the next one resumes from its checkpoint, from "
                "before this batch"
            ) from exc
        else:
            for optimizer in self._optimizers():
                optimizer.zero_grad(set_to_none=True)
            forget_unscale(self._scalers())  # an unscale_ before the update failed
        self.model.eval()
        if self.critic is not None:
            self.critic.model.eval()

    def _timed_step(self, groups: list[ExperienceGroup], version: int) -> dict[str, float]:
        lr = self._schedule()
        device = self.precision.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        metrics = self._train_step(groups, version)
        seconds = time.perf_counter() - started
        self.steps_trained += 1
        tokens = sum(e.num_tokens for g in groups for e in g.experiences)
        flops = step_flops(self.params, tokens, self.tcfg.ppo_epochs, self._frozen_passes())
        peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        speed = throughput_metrics(tokens, seconds, flops, self.peak_tflops, peak_bytes)
        return {**metrics, **speed, "train/lr": lr}

    def _frozen_passes(self) -> int:
        """Forward passes without grad a step makes besides the policy's own."""
        spec = self.algo.spec
        ref = self.ref_model is not None and spec.needs_reference
        return int(ref) + int(spec.needs_proximal) + int(self.teacher is not None)

    def _schedule(self) -> float:
        """The learning rates of this step (``trainer.lr_schedule``): the policy's, which
        it returns, and the critic's, by the same factor."""
        assert self.optimizer is not None, "prepare() first"
        factor = lr_factor(self.steps_trained, self.tcfg)
        set_lr(self.optimizer, self.tcfg.lr * factor)
        if self.critic is not None:
            set_lr(self.critic.optimizer, self.algo.spec.critic_lr * factor)
        return self.tcfg.lr * factor

    def _train_step(self, groups: list[ExperienceGroup], version: int) -> dict[str, float]:
        assert self.optimizer is not None, "prepare() first"
        if self.algo.spec.pairs:  # DPO: a loss of preference pairs, with its own step
            return dpo_step(
                self.model,
                self.optimizer,
                groups,
                self.tcfg,
                self.algo,
                self.tokenizer.pad_token_id,
                self.ref_model,
                self.precision,
            )
        return policy_step(
            self.model,
            self.optimizer,
            groups,
            self.tcfg,
            self.algo,
            self.tokenizer.pad_token_id,
            self.cfg.explorer.temperature,
            self.ref_model,
            version,
            self.precision,
            self.share,
            self.teacher,
            self.critic,
        )

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    retries_steps = True

    def retry_row_by_row(self, groups: list[ExperienceGroup], version: int) -> dict[str, float]:
        assert self.optimizer is not None, "prepare() first"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        whole = self.tcfg
        self.tcfg = msgspec.structs.replace(whole, micro_batch_size=1, max_tokens_per_micro_batch=0)
        try:
            return self.train_step(groups, version)
        finally:
            self.tcfg = whole

    def evaluate(self, evaluate: Evaluator) -> dict[str, float]:
        return evaluate(self.model, self.tokenizer)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.ckpt_root)

    def save(self, state: TrainerState) -> Path:
        assert self.optimizer is not None, "prepare() first"
        return save_checkpoint(
            self.ckpt_root,
            state,
            self.model,
            self.optimizer,
            self.tcfg.keep_checkpoints,
            self._extras(),
        )

    def load(self, path: Path) -> TrainerState:
        """Also the critic's weights and optimizer when the checkpoint has them; one
        without (a run that trained none) leaves the fresh critic ``prepare`` made."""
        assert self.optimizer is not None, "prepare() first"
        state = load_checkpoint(path, self.model, self.optimizer, self._extras())
        self.steps_trained = state.step
        return state

    def _extras(self) -> Extras:
        """What is checkpointed beside the policy: the critic, if any."""
        return {} if self.critic is None else {"critic": self.critic.model_pair()}


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation (gradient) checkpointing of every decoder layer, non-reentrant (works
    with frozen inputs, as under LoRA). transformers >= 5.21 names it
    ``activation_checkpointing_enable``; older ones ``gradient_checkpointing_enable``."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _fsdp2(cfg: Config) -> TrainEngine:
    from streamrft.consumers.fsdp_engine import FsdpTrainEngine  # imports this module

    return FsdpTrainEngine(cfg)


TRAIN_ENGINES: dict[str, Callable[[Config], TrainEngine]] = {
    "torch": TorchTrainEngine,
    "fsdp2": _fsdp2,
}
"""``trainer.engine`` -> the engine class."""


def check_train_engine(name: str) -> Callable[[Config], TrainEngine]:
    """The engine registered as ``name``; a :class:`ConfigError` naming the field if none."""
    if name not in TRAIN_ENGINES:
        raise ConfigError(
            f"trainer.engine: unknown engine {name!r}; known: {', '.join(TRAIN_ENGINES)}"
        )
    return TRAIN_ENGINES[name]


def make_train_engine(cfg: Config) -> TrainEngine:
    """The ``trainer.engine`` engine; ``torch`` is ``fsdp2`` with more than one rank."""
    name = cfg.trainer.engine
    if name == "torch" and cfg.trainer.world > 1:
        name = "fsdp2"
    return check_train_engine(name)(cfg)
