"""Wilson intervals and McNemar's exact test, against first principles."""

import math

from hypothesis import given
from hypothesis import strategies as st

from agl.eval.stats import mcnemar_exact, paired_change, wilson_interval


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
