"""Power of the exact McNemar test (agl.eval.stats.mcnemar_exact) for a paired comparison of two
policies on the same problems: how likely is p < alpha when the treatment's accuracy is ``--gain``
above the control's?

Per problem, the two policies' correctness are taken as independent given their accuracies (a
conservative choice: real errors are positively correlated, which leaves fewer discordant problems
and gives more power). Discordant problems are then Binomial(n, p_b + p_c) with p_b = p2 (1 - p1)
(gained) and p_c = p1 (1 - p2) (lost); given d discordant, the gained count is Binomial(d, p_b / (p_b + p_c)),
and the power sums P(d) P(reject | d) exactly. Loads no model; prints a table.

    PYTHONPATH=. /work/main/.venv/bin/python bench/mcnemar_power.py --n 1319 --control 0.0235 0.05 0.10 --gain 0.02
"""

from __future__ import annotations

import argparse
import functools
import math

from agl.eval.stats import mcnemar_exact


def binomial_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return float(k == 0)
    if p >= 1.0:
        return float(k == n)
    log = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    return math.exp(log)


@functools.cache
def rejected(discordant: int, alpha: float) -> tuple[int, ...]:
    """The gained counts (of ``discordant``) for which the two-sided exact test rejects at ``alpha``."""
    return tuple(b for b in range(discordant + 1) if mcnemar_exact(b, discordant - b) < alpha)


def power(n: int, control: float, treatment: float, alpha: float = 0.05) -> tuple[float, float]:
    """(power, expected discordant problems)."""
    gained, lost = treatment * (1 - control), control * (1 - treatment)
    p_discordant = gained + lost
    share = gained / p_discordant
    total, expected = 0.0, n * p_discordant
    for d in range(n + 1):
        weight = binomial_pmf(d, n, p_discordant)
        if d > expected and weight < 1e-12:
            break
        total += weight * sum(binomial_pmf(b, d, share) for b in rejected(d, alpha))
    return total, expected


def smallest_gain(n: int, control: float, target: float = 0.8, alpha: float = 0.05, step: float = 0.0025) -> float:
    gain = step
    while power(n, control, control + gain, alpha)[0] < target:
        gain += step
    return gain


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1319, help="paired problems (GSM8K test: 1,319)")
    parser.add_argument("--control", type=float, nargs="+", default=[0.0235, 0.05, 0.10])
    parser.add_argument("--gain", type=float, default=0.02)
    parser.add_argument("--alpha", type=float, default=0.05)
    args = parser.parse_args()
    print(f"| control accuracy | power for +{args.gain * 100:g} points | expected discordant | +points for 80% power |")
    print("| ---: | ---: | ---: | ---: |")
    for control in args.control:
        p, discordant = power(args.n, control, control + args.gain, args.alpha)
        print(f"| {control:.4f} | {p:.3f} | {discordant:.0f} | {smallest_gain(args.n, control) * 100:.2f} |")
