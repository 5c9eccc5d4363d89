"""Statistics for pass/fail scores: an interval for a rate, and a paired test of two policies;
and intervals of a mean (``mean_ci``, ``bootstrap_ci``: prompt search's ranking).

A greedy eval scores each task 0 or 1 (``correct``, ``format``, ...). Its rate gets a Wilson
score interval, which stays inside [0, 1] and is honest at rates near 0 or 1 and small n,
where mean +- 1.96 s/sqrt(n) is not. Two evals of the same tasks (the base model and the
trained one) are compared with McNemar's exact test: only the tasks on which they disagree
carry information, and under "no change" each disagreement is a fair coin.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a rate ``successes / n``.

    Examples:
        >>> [round(x, 4) for x in wilson_interval(5, 100)]
        [0.0215, 0.1118]
        >>> wilson_interval(0, 20)[0], wilson_interval(20, 20)[1]
        (0.0, 1.0)
    """
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At k = 0 (k = n) the bound is exactly 0 (1); say so rather than leave it to rounding.
    lo = 0.0 if successes == 0 else max(0.0, center - half)
    hi = 1.0 if successes == n else min(1.0, center + half)
    return lo, hi


def mcnemar_exact(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: ``gained`` tasks went 0 -> 1, ``lost`` went 1 -> 0.

    Examples:
        >>> mcnemar_exact(0, 0), mcnemar_exact(5, 5)
        (1.0, 1.0)
        >>> round(mcnemar_exact(10, 0), 5)  # 2 * 0.5**10
        0.00195
    """
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def mcnemar_power(n: int, gain_rate: float, loss_rate: float, alpha: float = 0.01) -> float:
    """The chance that McNemar's exact two-sided test on ``n`` paired tasks gives p < ``alpha``, when each task
    independently goes 0 -> 1 with probability ``gain_rate`` and 1 -> 0 with ``loss_rate``.

    The discordant tasks D are Binomial(n, gain_rate + loss_rate); given D = d, the gains are
    Binomial(d, gain_rate / (gain_rate + loss_rate)), and the test rejects for the gains whose p-value
    (``mcnemar_exact``) is under ``alpha``. Exact sums, in logs (no normal approximation).

    Examples:
        >>> round(mcnemar_power(100, 0.1, 0.0), 4)  # rejects from 8 gains and no loss on: P(Bin(100, 0.1) >= 8)
        0.7939
    """
    discordant = gain_rate + loss_rate
    if n <= 0 or discordant <= 0:
        return 0.0
    share = gain_rate / discordant
    return sum(
        _binomial_pmf(n, d, discordant) * _rejection_chance(d, share, alpha) for d in _likely_counts(n, discordant)
    )


def sample_size_for_power(
    gain_rate: float, loss_rate: float, alpha: float = 0.01, power: float = 0.8, max_n: int = 100_000
) -> int:
    """The fewest paired tasks from which McNemar's exact test reaches ``power`` at ``alpha`` (``mcnemar_power``),
    and keeps it at every size up to 10% more (an exact test's power saws up and down with n).

    Examples:
        >>> sample_size_for_power(0.1, 0.0, alpha=0.01, power=0.8)
        101
    """
    n = 1
    while n <= max_n:
        if mcnemar_power(n, gain_rate, loss_rate, alpha) >= power:
            ahead = next(
                (m for m in range(n + 1, int(n * 1.1) + 2) if mcnemar_power(m, gain_rate, loss_rate, alpha) < power),
                None,
            )
            if ahead is None:
                return n
            n = ahead
        n += 1
    raise ValueError(f"no size up to {max_n} reaches power {power} at alpha {alpha}")


@functools.cache
def _rejection_chance(d: int, share: float, alpha: float) -> float:
    """P(McNemar's exact p < alpha | d discordant tasks, each a gain with probability ``share``)."""
    return sum(_binomial_pmf(d, g, share) for g in range(d + 1) if mcnemar_exact(g, d - g) < alpha)


def _likely_counts(n: int, p: float, tail: float = 1e-12) -> range:
    """The counts of Binomial(n, p) outside which less than ``tail`` of its mass lies (a generous normal bound)."""
    sd = math.sqrt(n * p * (1 - p))
    return range(max(0, int(n * p - 12 * sd) - 2), min(n, int(n * p + 12 * sd) + 30) + 1)


def _binomial_pmf(n: int, k: int, p: float) -> float:
    if p <= 0 or p >= 1:
        return float(k == (n if p >= 1 else 0))
    log = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    return math.exp(log)


def is_binary(values: Sequence[float]) -> bool:
    return bool(values) and all(v in (0.0, 1.0) for v in values)


def rate_with_interval(values: Sequence[float]) -> dict[str, float]:
    """``{"rate", "lo", "hi", "n"}`` of 0/1 values.

    Examples:
        >>> rate_with_interval([1, 0, 0, 0])["rate"]
        0.25
    """
    n, k = len(values), int(sum(values))
    lo, hi = wilson_interval(k, n)
    return {"rate": k / n if n else float("nan"), "lo": lo, "hi": hi, "n": n}


def paired_change(before: Mapping[Any, float], after: Mapping[Any, float]) -> dict[str, float]:
    """Compare 0/1 scores of the same tasks (keys) before and after: rates, the tasks gained and
    lost, and McNemar's exact p-value. Tasks scored only once are left out.

    Examples:
        >>> paired_change({"a": 0, "b": 0, "c": 1}, {"a": 1, "b": 1, "c": 1, "d": 1})
        {'n': 3, 'before': 0.3333333333333333, 'after': 1.0, 'gained': 2, 'lost': 0, 'p': 0.5}
    """
    tasks = [t for t in before if t in after]
    gained = sum(1 for t in tasks if after[t] > before[t])
    lost = sum(1 for t in tasks if after[t] < before[t])
    n = len(tasks)
    return {
        "n": n,
        "before": sum(before[t] for t in tasks) / n if n else float("nan"),
        "after": sum(after[t] for t in tasks) / n if n else float("nan"),
        "gained": gained,
        "lost": lost,
        "p": mcnemar_exact(gained, lost),
    }


def mean_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high): the normal-approximation 95% interval mean +- z * s / sqrt(n).

    ``s`` is the sample standard deviation (n - 1). With n < 2 the interval is the mean itself.
    """
    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def bootstrap_ci(
    values: Sequence[float], resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean: resample the values with replacement."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return means[int(tail * (resamples - 1))], means[int(round((1 - tail) * (resamples - 1)))]
