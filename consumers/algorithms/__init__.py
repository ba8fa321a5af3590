"""RL algorithms as registries of parts, and the policy step that uses them.

Registries (name -> pure function of tensors), one module each:

- :data:`ADVANTAGES` (``advantages.py``): ``grpo``, ``rloo``, ``reinforce_plus_plus``,
  ``reinforce_plus_plus_baseline``, ``opmd``, ``none``, ``distill`` (on-policy
  distillation: the teacher's log-probs of the sampled tokens, ``consumers/teacher.py``),
  ``gae`` (PPO: a critic's values, ``consumers/critic.py``; its loss in ``value_loss.py``).
- :data:`POLICY_LOSSES` (``policy_losses.py``): ``ppo_clip``, ``gspo``, ``cispo``, ``opmd``,
  ``sft``, and ``dpo``: a marker for DPO, a loss of preference pairs with its own step
  (``dpo.py``, :func:`~.dpo.dpo_step`), which the train engine takes for it.
- :data:`KL_ESTIMATORS` (``kl.py``): ``k1``, ``k2``, ``k3``, ``low_var_kl``, ``abs``, for
  the KL penalty in the reward and the KL term of the loss.
- :data:`LOSS_AGG` (``aggregation.py``): ``token-mean``, ``seq-mean-token-mean``,
  ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``.
- :data:`CORRECTIONS` (``corrections.py``): off-policy corrections of stale experiences.
- :data:`ALGORITHMS` (``presets.py``): presets of the above chosen by ``algorithm.type``;
  :func:`resolve_algorithm` turns a config into the settings (:class:`AlgorithmSpec`,
  ``spec.py``) and the functions.

Adding a part is a function in its module and a line in its registry.
"""

from __future__ import annotations

from streamrft.consumers.algorithms.advantages import ADVANTAGES, AdvantageFn, AdvantageInputs
from streamrft.consumers.algorithms.aggregation import LOSS_AGG, AggregateFn
from streamrft.consumers.algorithms.corrections import CORRECTIONS
from streamrft.consumers.algorithms.kl import KL_ESTIMATORS, KlFn
from streamrft.consumers.algorithms.policy_losses import POLICY_LOSSES, LossInputs, PolicyLossFn
from streamrft.consumers.algorithms.presets import (
    ALGORITHMS,
    Preset,
    ResolvedAlgorithm,
    resolve_algorithm,
    resolve_spec,
)
from streamrft.consumers.algorithms.spec import AlgorithmSpec
from streamrft.consumers.algorithms.step import policy_step

__all__ = [
    "ADVANTAGES",
    "ALGORITHMS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "LOSS_AGG",
    "POLICY_LOSSES",
    "AdvantageFn",
    "AdvantageInputs",
    "AggregateFn",
    "AlgorithmSpec",
    "KlFn",
    "LossInputs",
    "PolicyLossFn",
    "Preset",
    "ResolvedAlgorithm",
    "policy_step",
    "resolve_algorithm",
    "resolve_spec",
]
