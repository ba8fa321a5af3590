"""Algorithms as presets of registered parts, and the one place config names become parts.

``trainer.algorithm`` picks a preset of :data:`ALGORITHMS`; ``trainer.advantage_fn``,
``trainer.policy_loss_fn`` and ``trainer.kl_loss_fn`` replace one of its parts when set.
Config validation cannot see these registries (the config is a lower layer), so the
trainer calls :func:`resolve_algorithm` when it starts: an unknown name is a
:class:`ConfigError` naming the field and the known names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from streamrft.consumers.algorithms.advantages import ADVANTAGES, AdvantageFn
from streamrft.consumers.algorithms.aggregation import LOSS_AGG, AggregateFn
from streamrft.consumers.algorithms.kl_losses import KL_LOSSES, KlLossFn
from streamrft.consumers.algorithms.policy_losses import POLICY_LOSSES, PolicyLossFn
from streamrft.infra.config import TrainerConfig
from streamrft.schemas.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Algorithm:
    """A preset: the registered name of each part."""

    advantage: str
    """Key of :data:`ADVANTAGES`."""
    policy_loss: str
    """Key of :data:`POLICY_LOSSES`."""
    kl_loss: str
    """Key of :data:`KL_LOSSES`."""


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(advantage="grpo", policy_loss="ppo_clip", kl_loss="k3"),
}
"""``trainer.algorithm`` -> preset."""


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """The functions one training run uses, looked up once from config."""

    name: str
    advantage: AdvantageFn
    policy_loss: PolicyLossFn
    kl_loss: KlLossFn
    aggregate: AggregateFn
    """The ``trainer.loss_agg_mode`` aggregation (of the KL term; losses aggregate their own)."""


def resolve_algorithm(cfg: TrainerConfig) -> ResolvedAlgorithm:
    """The parts ``cfg`` names; a :class:`ConfigError` naming the field for any unknown name."""
    preset = _lookup(ALGORITHMS, cfg.algorithm, "trainer.algorithm", "")
    origin = f" (trainer.algorithm {cfg.algorithm!r})"
    return ResolvedAlgorithm(
        name=cfg.algorithm,
        advantage=_lookup(
            ADVANTAGES,
            cfg.advantage_fn or preset.advantage,
            "trainer.advantage_fn",
            "" if cfg.advantage_fn else origin,
        ),
        policy_loss=_lookup(
            POLICY_LOSSES,
            cfg.policy_loss_fn or preset.policy_loss,
            "trainer.policy_loss_fn",
            "" if cfg.policy_loss_fn else origin,
        ),
        kl_loss=_lookup(
            KL_LOSSES,
            cfg.kl_loss_fn or preset.kl_loss,
            "trainer.kl_loss_fn",
            "" if cfg.kl_loss_fn else origin,
        ),
        aggregate=_lookup(LOSS_AGG, cfg.loss_agg_mode, "trainer.loss_agg_mode", ""),
    )


def _lookup(registry: dict[str, T], name: str, field: str, origin: str) -> T:
    try:
        return registry[name]
    except KeyError:
        raise ConfigError(
            f"{field}: unknown name {name!r}{origin}; known: {', '.join(registry)}"
        ) from None
