"""Informative batches (agl/train/sampling.py): which groups teach, how many more tasks a step draws, the warning
when steps learn nothing, and the final table that tells the warm-up's change from GRPO's.

The draws' arithmetic is checked on its own (hypothesis); the job's behaviour on the reference run (tests/runs.py:
dynamic sampling on, every fourth task never solved), whose kill -9 exactness tests/test_reproducible.py checks.
"""

from __future__ import annotations

import doctest
import json

from hypothesis import given
from hypothesis import strategies as st
from runs import GROUPS_PER_STEP, all_metrics, query

import agl.train.sampling
from agl.config import GRPOConfig
from agl.report.run_report import learning_table
from agl.train.sampling import LOW_SHARE_STEPS, GroupDraws, InformativeWatch, is_informative, next_draw


@given(
    batch=st.integers(1, 16),
    drawn=st.integers(1, 64),
    informative=st.integers(0, 64),
    extra_left=st.integers(0, 64),
)
def test_a_round_draws_the_shortfall_at_the_rate_seen_within_the_bound(batch, drawn, informative, extra_left):
    informative = min(informative, drawn)
    size = next_draw(batch, drawn, informative, extra_left)
    assert 0 <= size <= extra_left
    if informative >= batch or extra_left == 0:
        assert size == 0
    else:  # all that is left, or enough to fill the shortfall if the share so far holds, and not one more
        seen = max(informative, 1)  # the share so far, seen / drawn (one assumed where none was)
        assert size == extra_left or size * seen >= (batch - informative) * drawn > (size - 1) * seen


@given(
    flags=st.lists(st.booleans(), max_size=60),
    batch=st.integers(1, 8),
    extra=st.integers(0, 24),
)
def test_a_step_draws_until_b_groups_are_informative_or_the_bound(flags, batch, extra):
    """Tasks drawn in order, each informative or not (``flags``; past the list, none is): the step stops at the
    first round that completes B informative groups, or at B + extra tasks, and keeps the first B in draw order."""
    draws, order = GroupDraws(batch, extra), []
    while size := draws.next_round():
        groups = list(range(draws.drawn, draws.drawn + size))
        rewards = {g: [0.0, float(g < len(flags) and flags[g])] for g in groups}
        draws.add(groups, rewards)
        order += groups
    informative = [g for g in order if g < len(flags) and flags[g]]
    assert draws.drawn == len(order) <= batch + extra and draws.informative == informative
    assert len(informative) >= batch or draws.drawn == batch + extra
    assert draws.kept() == informative[:batch]
    if extra == 0:
        assert draws.rounds == 1 and draws.drawn == batch


def test_informative_means_unequal_rewards():
    assert is_informative([0.1, 0.1, 0.2]) and is_informative([1.0, 0.0])
    assert not is_informative([0.0] * 8) and not is_informative([1.0]) and not is_informative([])
    result = doctest.testmod(agl.train.sampling)
    assert result.attempted > 0 and result.failed == 0


def test_steps_that_learn_little_get_one_warning_naming_what_to_try():
    algo = GRPOConfig()
    watch = InformativeWatch()
    assert watch.check(0.1, algo) is None and watch.check(0.5, algo) is None  # a good step ends a streak
    lines = [watch.check(share, algo) for share in [0.0, 0.2] + [0.0] * 5]
    warned = [line for line in lines if line]
    assert len(warned) == 1 and lines.index(warned[0]) == LOW_SHARE_STEPS - 1
    for advice in ("algo.group_size=16", "algo.temperature=1", "algo.dynamic_sampling=true", "partial credit"):
        assert advice in warned[0], warned[0]
    again = InformativeWatch(**json.loads(json.dumps(watch.state())))  # a resumed job does not warn twice
    assert all(again.check(0.0, algo) is None for _ in range(5))
    dynamic = InformativeWatch(streak=LOW_SHARE_STEPS - 1).check(0.0, GRPOConfig(dynamic_sampling=True))
    assert "algo.max_extra_groups=24" in dynamic and "dynamic_sampling=true" not in dynamic


def test_the_reference_run_drew_more_where_groups_tied(reference):
    """tests/runs.py's docstring: step 1 drew 2 + 2 tasks, 3 informative, trained on 2; step 2 drew 2 + 2 (the
    bound), 1 informative, trained on it. Every draw's rollouts are recorded under its step and round."""
    grpo = [row for row in all_metrics(reference) if row.get("stage") == "grpo"]
    shown = [
        (row["groups_drawn"], row["groups_informative"], row["groups_trained"], row["draw_rounds"]) for row in grpo
    ]
    assert shown == [(GROUPS_PER_STEP, 3, 2, 2), (GROUPS_PER_STEP, 1, 1, 2)]
    assert [row["informative_share"] for row in grpo] == [0.75, 0.25]
    assert [row["samples_trained"] for row in grpo] == [2 * 4, 1 * 4]  # x group_size: one sample per rollout
    rounds = query(
        reference,
        "SELECT json_extract(metadata, '$.step'), json_extract(metadata, '$.round'), "
        "count(DISTINCT json_extract(metadata, '$.group')) FROM rollouts WHERE mode = 'train' GROUP BY 1, 2",
    )
    assert rounds == [(1, None, 2), (1, 1, 2), (2, None, 2), (2, 1, 2)]


def test_the_final_table_tells_the_warm_up_from_grpo(reference):
    """The eval at the warm-up's end takes the final eval's 6 problems; the final row compares with it (``_rl_``)
    and the table prints base -> after warm-up -> after GRPO with each phase's McNemar test."""
    evals = query(
        reference,
        "SELECT json_extract(metadata, '$.eval_step'), count(*) FROM rollouts "
        "WHERE json_extract(metadata, '$.eval_step') IS NOT NULL GROUP BY 1",
    )
    assert evals == [(0, 6), (1, 6), (2, 4), (3, 6)]  # the baseline, the warm-up's end, step 2 (a slice), the end
    rows = all_metrics(reference)
    final, warm = rows[-1], rows[1]
    assert warm["stage"] == "sft" and warm["eval_all/n"] == 6 and "eval_all/said_a_p" in warm
    assert final["eval_all/said_a_rl_base"] == warm["eval_all/said_a"]
    assert final["eval_all/said_a_rl_gained"] + final["eval_all/said_a_rl_lost"] <= 6
    table = learning_table(rows)
    assert table.startswith("base model -> after the SFT warm-up (1 step) -> after GRPO (2 steps), the same 6 tasks")
    header = next(line for line in table.splitlines() if line.startswith("| score"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "score",
        "base",
        "after warm-up",
        "after GRPO",
        "warm-up's change",
        "GRPO's change",
        "whole job",
    ]
    said_a = next(line for line in table.splitlines() if line.startswith("| said_a "))
    rl = f"+{int(final['eval_all/said_a_rl_gained'])} -{int(final['eval_all/said_a_rl_lost'])}, p="
    assert rl in said_a
