"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", eq. 1 and its numerically stable form in Fig. 3).

For one prompt with n samples of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)
           = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

the probability that a random k-subset of the n samples holds at least one correct one.
With k == n it is 1 if any sample is correct; with k == 1 it is c / n. The benchmark
value is the mean over prompts.
"""
from __future__ import annotations

from typing import List, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:          # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(n: int, correct_counts: Sequence[int], k: int) -> float:
    """Mean over prompts of pass@k, each prompt having n samples."""
    if not correct_counts:
        return 0.0
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)


def report_ks(n: int) -> List[int]:
    """The k reported for n samples: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]
