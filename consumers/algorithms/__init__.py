"""RL algorithms as registries of parts, and the policy step that uses them.

Registries (name -> pure function of tensors), one module each:

- :data:`ADVANTAGES` (``advantages.py``): ``grpo``.
- :data:`POLICY_LOSSES` (``policy_losses.py``): ``ppo_clip``.
- :data:`KL_LOSSES` (``kl_losses.py``): ``k3``.
- :data:`LOSS_AGG` (``aggregation.py``): ``token-mean``, ``seq-mean-token-mean``,
  ``seq-mean-token-sum``.
- :data:`ALGORITHMS` (``presets.py``): presets of the above chosen by ``trainer.algorithm``
  (``grpo``); :func:`resolve_algorithm` turns a trainer config into the functions.

Adding a part is a function in its module and a line in its registry.
"""

from __future__ import annotations

from streamrft.consumers.algorithms.advantages import ADVANTAGES, AdvantageFn
from streamrft.consumers.algorithms.aggregation import LOSS_AGG, AggregateFn
from streamrft.consumers.algorithms.kl_losses import KL_LOSSES, KlLossFn
from streamrft.consumers.algorithms.policy_losses import POLICY_LOSSES, PolicyLossFn
from streamrft.consumers.algorithms.presets import (
    ALGORITHMS,
    Algorithm,
    ResolvedAlgorithm,
    resolve_algorithm,
)
from streamrft.consumers.algorithms.step import policy_step

__all__ = [
    "ADVANTAGES",
    "ALGORITHMS",
    "KL_LOSSES",
    "LOSS_AGG",
    "POLICY_LOSSES",
    "AdvantageFn",
    "AggregateFn",
    "Algorithm",
    "KlLossFn",
    "PolicyLossFn",
    "ResolvedAlgorithm",
    "policy_step",
    "resolve_algorithm",
]
