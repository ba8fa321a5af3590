"""PPO's critic: a value model trained beside the policy, in the same process.

The value model is a copy of the policy's backbone (the decoder without its language-model
head, e.g. ``LlamaModel``) with a linear value head, made from the policy after any
warm-up. The value of response token t is the value of the state before it: the head of
the hidden state at position t - 1, the same shift as the policy's log-probs
(``consumers/batching.py`` ``logprobs_and_entropy``).

Each step (``gae``, the ``ppo`` preset): the batch's values without grad before the
advantages, then, after the policy's update, ``trainer.ppo_epochs`` passes of the clipped
value loss (:mod:`.algorithms.value_loss`) towards the GAE returns, each one AdamW step
(``algorithm.critic_lr``, ``trainer.weight_decay``, ``trainer.betas``) over the policy's
micro-batches, its gradient clipped at ``trainer.grad_clip``. The loss is the mean over
the batch's trained tokens, whatever the micro-batches.

Weights are float32 and the forward runs under the policy's autocast, with its own loss
scaler under float16. With LoRA (``model.lora.enabled``) the critic is still a full,
fully trained copy of the base backbone. It is checkpointed with the policy
(``critic.safetensors``, ``critic_optimizer.*``: :mod:`.checkpoint`).
"""

from __future__ import annotations

import copy

import torch

from streamrft.consumers.algorithms.policy_losses import masked_mean
from streamrft.consumers.algorithms.value_loss import clipped_value_loss, explained_variance
from streamrft.consumers.batching import PolicyBatch
from streamrft.consumers.precision import Precision
from streamrft.infra.config import TrainerConfig

HEAD_INIT_STD = 0.01
"""The value head starts near 0 (weights of this std, bias 0)."""

Slices = list[tuple[int, int]]


class ValueModel(torch.nn.Module):
    """A decoder backbone and a linear head: one value per response token."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.normal_(self.head.weight, std=HEAD_INIT_STD)
        torch.nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: torch.nn.Module) -> ValueModel:
        """A copy of ``policy``'s backbone (a Hugging Face ``...ForCausalLM``'s
        ``base_model``) with a fresh head, on the policy's device, float32."""
        backbone = copy.deepcopy(policy.base_model).float()
        head_device = next(backbone.parameters()).device
        return cls(backbone, policy.config.hidden_size).to(head_device)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int
    ) -> torch.Tensor:
        """``(B, R)`` float32 values of the states before each response token."""
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.head(hidden[:, prompt_width - 1 : -1]).squeeze(-1).float()


class Critic:
    """The value model, its AdamW and the settings of its update."""

    def __init__(
        self,
        model: ValueModel,
        cfg: TrainerConfig,
        lr: float,
        value_clip: float,
        precision: Precision,
    ) -> None:
        self.model = model.eval()
        self.cfg = cfg
        self.clip = value_clip
        self.precision = Precision.of(precision.device, precision.dtype)  # its own scaler
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=cfg.weight_decay, betas=cfg.betas
        )

    def model_pair(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The value model and its optimizer, as a checkpoint saves them."""
        return self.model, self.optimizer

    @torch.no_grad()
    def values(self, batch: PolicyBatch, slices: Slices) -> torch.Tensor:
        """``(B, R)`` values of the batch, one micro-batch at a time; 0 off the response
        mask."""
        out = torch.zeros_like(batch.old_logprobs)
        for lo, hi in slices:
            rows = batch.rows(lo, hi)
            with self.precision.autocast():
                v = self.model(rows.input_ids, rows.attention_mask, rows.prompt_width)
            out[lo:hi, : v.shape[1]] = v
        return out * batch.response_mask

    def update(
        self,
        batch: PolicyBatch,
        slices: Slices,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
    ) -> dict[str, float]:
        """``trainer.ppo_epochs`` steps of the clipped value loss towards ``returns`` on
        the tokens of ``mask``; the metrics (``train/value_*``)."""
        metrics = {
            "train/value_mean": masked_mean(old_values, mask),
            "train/value_explained_var": explained_variance(old_values, returns, mask),
            "train/return_mean": masked_mean(returns, mask),
        }
        whole = float(mask.sum())
        if whole == 0:
            return metrics
        self.model.train()
        loss_sum = clipped_sum = 0.0
        for _ in range(self.cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for lo, hi in slices:
                rows = batch.rows(lo, hi)
                width = rows.response_mask.shape[1]
                m = mask[lo:hi, :width]
                with self.precision.autocast():
                    v = self.model(rows.input_ids, rows.attention_mask, rows.prompt_width)
                per_token, clipped = clipped_value_loss(
                    v, old_values[lo:hi, :width], returns[lo:hi, :width], self.clip
                )
                loss = (per_token * m).sum() / whole
                self.precision.backward(loss)
                loss_sum += float(loss.detach())
                clipped_sum += float((clipped * m).sum()) / whole
            grad_norm = self.precision.step(self.model, self.optimizer, self.cfg.grad_clip)
        self.model.eval()
        epochs = self.cfg.ppo_epochs
        return {
            **metrics,
            "train/value_loss": loss_sum / epochs,
            "train/value_clipfrac": clipped_sum / epochs,
            "train/value_grad_norm": float(grad_norm),
        }
