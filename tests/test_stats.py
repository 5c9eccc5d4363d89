"""Wilson intervals, McNemar's exact test and its power, against first principles; the end evals' rows."""

import math
import random
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf

from agl.eval.evaluate import end_eval_rows
from agl.eval.stats import mcnemar_exact, mcnemar_power, paired_change, sample_size_for_power, wilson_interval


@given(n=st.integers(1, 2000), data=st.data())
def test_wilson_interval_holds_the_rate_inside_0_1(n, data):
    k = data.draw(st.integers(0, n))
    lo, hi = wilson_interval(k, n)
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    # more of the same evidence narrows it
    lo4, hi4 = wilson_interval(4 * k, 4 * n)
    assert hi4 - lo4 < hi - lo


def test_wilson_interval_known_values():
    # statsmodels' proportion_confint(k, n, method="wilson")
    assert [round(x, 4) for x in wilson_interval(13, 1319)] == [0.0058, 0.0168]
    assert [round(x, 4) for x in wilson_interval(66, 1319)] == [0.0395, 0.0632]


@given(gained=st.integers(0, 60), lost=st.integers(0, 60))
def test_mcnemar_is_the_two_sided_binomial_test_of_the_discordant_pairs(gained, lost):
    n = gained + lost
    # every outcome at least as far from n/2 as the observed one, under a fair coin
    extreme = sum(math.comb(n, i) for i in range(n + 1) if abs(i - n / 2) >= abs(gained - n / 2)) / 2**n
    assert math.isclose(mcnemar_exact(gained, lost), min(1.0, extreme), rel_tol=1e-12)
    assert mcnemar_exact(gained, lost) == mcnemar_exact(lost, gained)


@given(
    st.dictionaries(st.integers(0, 50), st.tuples(st.sampled_from([0.0, 1.0]), st.sampled_from([0.0, 1.0])), min_size=1)
)
def test_paired_change_counts_only_the_tasks_that_moved(pairs):
    before = {t: b for t, (b, _) in pairs.items()}
    after = {t: a for t, (_, a) in pairs.items()}
    change = paired_change(before, after)
    assert change["gained"] == sum(a > b for b, a in pairs.values())
    assert change["lost"] == sum(a < b for b, a in pairs.values())
    assert math.isclose(change["after"] - change["before"], (change["gained"] - change["lost"]) / len(pairs))


def test_doctests():
    import doctest

    import agl.eval.evaluate
    import agl.eval.stats
    import agl.seeding
    import agl.train.loss

    for module in (agl.eval.stats, agl.seeding, agl.eval.evaluate, agl.train.loss):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_mcnemar_power_matches_a_simulation_and_sizes_the_gsm8k_evals():
    """The exact power against a seeded simulation of the same paired evals, and the size conf/task/gsm8k.yaml uses:
    the fewest problems with 80% power at p < 0.01 for the smaller measured gain (+24 -0 of 1,319; RESULTS.md)."""
    rng = random.Random(0)
    n, gain, loss, trials = 300, 0.03, 0.005, 3000
    rejected = 0
    for _ in range(trials):
        draws = [rng.random() for _ in range(n)]
        gained, lost = sum(u < gain for u in draws), sum(gain <= u < gain + loss for u in draws)
        rejected += mcnemar_exact(gained, lost) < 0.01
    assert abs(mcnemar_power(n, gain, loss) - rejected / trials) < 0.03  # 3 standard errors
    assert mcnemar_power(500, 0.02, 0.0) < mcnemar_power(1000, 0.02, 0.0)
    size = sample_size_for_power(24 / 1319, 0.0, alpha=0.01, power=0.8)
    assert size == 561 and mcnemar_power(size - 1, 24 / 1319, 0.0) < 0.8 <= mcnemar_power(size, 24 / 1319, 0.0)
    assert sample_size_for_power(31 / 1319, 0.0) < size
    task = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "task" / "gsm8k.yaml")
    assert task.final_eval_size == size


@given(st.integers(0, 40), st.integers(0, 12), st.one_of(st.none(), st.integers(0, 50)), st.integers(0, 3))
def test_the_end_evals_are_the_slice_then_a_seeded_choice(n, eval_size, final_size, seed):
    rows = [{"id": i} for i in range(n)]
    chosen = end_eval_rows(rows, eval_size, final_size, seed)
    head = rows[:eval_size] if eval_size else rows
    assert chosen[: min(len(head), len(chosen))] == head[: len(chosen)]  # the periodic slice first
    ids = [r["id"] for r in chosen]
    assert ids == sorted(set(ids))  # distinct, in the split's order
    expected = len(head) if final_size is None else n if not final_size else min(final_size, n)
    assert len(chosen) == expected
    assert end_eval_rows(rows, eval_size, final_size, seed) == chosen  # the seed alone decides
