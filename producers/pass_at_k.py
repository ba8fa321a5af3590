"""pass@k: the chance that at least one of k samples of a task is correct. Pure math.

The unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", the Codex paper): draw ``n >= k`` samples of a task, count the ``c`` correct ones,
and pass@k = 1 - C(n-c, k) / C(n, k), the chance that k of the n samples drawn without
replacement include a correct one. Averaged over tasks it estimates the expected pass@k
with less variance than drawing exactly k samples per task. The ratio of binomials is
computed as a product, as in the paper's reference code, so large ``n`` never overflows.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one task from ``c`` correct among ``n`` samples (``1 <= k <= n``)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n samples; got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct samples c={c} must lie in [0, n={n}]")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) = prod over i in (n-c, n] of (1 - k/i)
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(correct: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over tasks; ``correct[i]``: correct samples of task i out of ``n``."""
    if not correct:
        raise ValueError("pass@k of no tasks")
    return sum(pass_at_k(n, c, k) for c in correct) / len(correct)
