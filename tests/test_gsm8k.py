"""Tests for the GSM8K task: data loading, answer extraction, scoring."""

import doctest
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.gsm8k import data, scoring
from tasks.gsm8k.data import load_split, solution_text
from tasks.gsm8k.scoring import (
    answer_not_last,
    extract_lenient,
    extract_strict,
    normalize_number,
    numbers_equal,
    reward,
    score,
)

# ---------------------------------------------------------------- data


@pytest.mark.parametrize("split,n", [("train", 7473), ("test", 1319)])
def test_split_sizes_and_golds(split, n):
    rows = load_split(split)
    assert len(rows) == n
    assert rows[0]["id"] == f"{split}-0" and rows[-1]["id"] == f"{split}-{n - 1}"
    for row in rows:
        assert set(row) == {"id", "question", "answer", "gold"}
        assert "," not in row["gold"]
        assert normalize_number(row["gold"]) == row["gold"], row  # every gold is a plain number
        demo = solution_text(row)
        assert "<<" not in demo and ">>" not in demo
        assert extract_strict(demo) == row["gold"]  # demonstrations round-trip through the scorer


def test_first_train_row():
    row = load_split("train")[0]
    assert row["gold"] == "72"
    assert row["question"].startswith("Natalia sold clips")
    assert solution_text(row) == (
        "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"
    )


def test_load_split_is_cached_and_cwd_independent(tmp_path, monkeypatch):
    first = load_split("test")
    monkeypatch.chdir(tmp_path)
    assert load_split("test") is first


def test_unknown_split():
    with pytest.raises(ValueError, match="valid splits: train, test"):
        load_split("validation")


# ---------------------------------------------------------------- doctests


@pytest.mark.parametrize("module", [scoring, data])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- extraction units


WHY = "Half of 48 is 24, so the total is 48 + 24.\n"  # enough reasoning before an answer line


@pytest.mark.parametrize(
    "answer,expected",
    [
        ("#### 72", "72"),
        ("#### 72.", "72"),  # trailing period
        ("#### 72 .\n", "72"),
        ("####72", "72"),
        ("#### 72\n\n  \n", "72"),  # trailing blank lines
        ("#### 1,234", "1234"),  # thousands separators
        ("#### 1,234,567.", "1234567"),
        ("#### $72", "72"),  # dollar prefix
        ("#### $1,200.50", "1200.5"),
        ("#### -7", "-7"),  # negatives
        ("#### -$7", "-7"),
        ("#### -3.5", "-3.5"),  # decimals
        ("#### .5", "0.5"),
        ("#### -.25", "-0.25"),
        ("#### 72.0", "72"),  # trailing .0
        ("#### 72.00", "72"),
        ("#### 0", "0"),
        ("#### -0.0", "0"),
        # not well formed -> None
        ("#### 1\nmore text\n#### 2\n", None),  # two answer lines
        ("#### 2\n\nQuestion: next one has 9 apples", None),  # the answer line is not last
        ("The answer is 72", None),
        ("", None),
        ("####", None),
        ("#### \n72", None),
        ("#### seventy-two", None),
        ("#### 72 apples", None),
        ("#### 1,23", None),
        ("#### 72\n#### unsure", None),
    ],
)
def test_extract_strict(answer, expected):
    assert extract_strict(WHY + answer) == expected


@pytest.mark.parametrize("text", ["#### 72", "72\n#### 72", "Total: 72\n#### 72", " \n\n#### 72"])
def test_extract_strict_needs_reasoning_first(text):
    assert extract_strict(text) is None and score(text, "72") == {"format": False, "correct": False}


@pytest.mark.parametrize(
    "text,expected",
    [
        (WHY + "#### 12", "12"),  # strict wins when well formed
        ("#### 12\nI think 13", "13"),  # otherwise the last number
        ("So the total is 72.", "72"),
        ("3 + 4 = 7", "7"),  # the last number
        ("It costs $1,234.50 in total.", "1234.5"),
        ("The change is -3.5 degrees", "-3.5"),
        ("5-3 = 2", "2"),
        ("10-3", "3"),  # a subtraction's minus is not a sign
        ("x = -3", "-3"),
        ("About .5 of it", "0.5"),
        ("There are 1,000 sheep, 2 dogs.", "2"),
        ("No numbers here.", None),
        ("", None),
    ],
)
def test_extract_lenient(text, expected):
    assert extract_lenient(text) == expected


@pytest.mark.parametrize(
    "a,b",
    [
        ("72", "72.0"),
        ("72", "$72"),
        ("72", "72.00"),
        ("1,000", "1000"),
        ("-3.5", "-3.50"),
        (".5", "0.5"),
        ("0.1", "0.10"),
        ("-0", "0"),
        ("72.", "72"),
    ],
)
def test_numbers_equal(a, b):
    assert numbers_equal(a, b) and numbers_equal(b, a)


@pytest.mark.parametrize(
    "a,b", [("72", "73"), ("0.1", "0.10000001"), ("72", None), (None, None), ("72", "abc"), ("-5", "5")]
)
def test_numbers_not_equal(a, b):
    assert not numbers_equal(a, b)


def test_normalize_number():
    assert normalize_number("  1,234.500 ") == "1234.5"
    assert normalize_number("1e5") is None
    assert normalize_number("nan") is None
    assert normalize_number("1 2") is None


# ---------------------------------------------------------------- score / reward


def test_score_and_reward():
    good, wrong, unformatted = WHY + "#### 72", WHY + "#### 71", "so the answer is 72"
    assert score(good, "72") == {"format": True, "correct": True}
    assert score(wrong, "72") == {"format": True, "correct": False}
    assert score(unformatted, "72") == {"format": False, "correct": False}
    assert score(unformatted, "72", strict=False) == {"format": False, "correct": True}
    assert reward(good, "72") == 1.0
    assert reward(WHY + "#### $72.00.", "72") == 1.0
    assert reward("#### 72\n" + WHY, "72") == 0.0  # answer first: no format credit, not graded correct
    assert reward(wrong, "72") == 0.1
    assert reward(wrong, "72", format_bonus=0.0) == 0.0
    assert reward(unformatted, "72") == 0.0  # lenient-correct still earns nothing


# ---------------------------------------------------------------- property tests

# Prose without digits, '#', '$', '-', '.' or ',' so it cannot add or glue onto numbers.
prose = st.text(alphabet=st.characters(codec="ascii", categories=["L", "Zs"]), max_size=40)
integers = st.integers(min_value=-(10**9), max_value=10**9).map(Decimal)
decimals = st.decimals(min_value=-(10**6), max_value=10**6, places=3, allow_nan=False, allow_infinity=False)
values = st.one_of(integers, decimals)
formats = st.sampled_from(["plain", "commas", "dollar", "dollar_commas", "trailing_zero", "period"])


def render(value: Decimal, fmt: str) -> str:
    """Write ``value`` the way a model might."""
    sign, body = ("-" if value < 0 else ""), abs(value)
    if fmt == "plain":
        return f"{sign}{body}"
    if fmt == "commas":
        return f"{sign}{body:,}"
    if fmt == "dollar":
        return f"{sign}${body}"
    if fmt == "dollar_commas":
        return f"{sign}${body:,}"
    if fmt == "trailing_zero":
        text = f"{sign}{body}"
        return text + ("0" if "." in text else ".0")
    if fmt == "period":
        return f"{sign}{body}."
    raise ValueError(fmt)


@settings(max_examples=300, deadline=None)
@given(value=values, fmt=formats, before=prose, after=st.sampled_from(["", " ", ".", " .", "!\n", "\n\n \n"]))
def test_strict_recovers_rendered_number(value, fmt, before, after):
    text = f"{WHY}{before}\n#### {render(value, fmt)}{after}"
    assert numbers_equal(extract_strict(text), str(value)), text
    assert reward(text, str(value)) == 1.0 and not answer_not_last(text)


@settings(max_examples=300, deadline=None)
@given(value=values, fmt=formats, before=prose, after=st.text(min_size=1, max_size=40).filter(lambda t: t.strip()))
def test_anything_after_the_answer_line_voids_it(value, fmt, before, after):
    """Text after the answer line (the reward hack: answer first, reasoning after) earns nothing."""
    text = f"{WHY}{before}\n#### {render(value, fmt)}\n{after}"
    assert extract_strict(text) is None
    assert reward(text, str(value)) == 0.0
    assert answer_not_last(text) or text.count("####") > 1


@settings(max_examples=200, deadline=None)
@given(value=values, first=values, before=prose)
def test_two_answer_lines_void_both(value, first, before):
    text = f"{WHY}#### {first}\n{before}\n#### {value}"
    assert extract_strict(text) is None and reward(text, str(value)) == 0.0


@settings(max_examples=200, deadline=None)
@given(value=values, reasoning=st.text(max_size=60))
def test_well_formed_needs_enough_reasoning(value, reasoning):
    text = f"{reasoning}\n#### {value}"
    if len("".join(reasoning.split())) < scoring.MIN_REASONING_CHARS:
        assert extract_strict(text) is None


@settings(max_examples=300, deadline=None)
@given(value=values, fmt=formats, before=prose, after=prose)
def test_lenient_recovers_rendered_number_in_prose(value, fmt, before, after):
    rendered = render(value, fmt)
    extracted = extract_lenient(f"{before} {rendered} {after}")
    assert numbers_equal(extracted, str(value)), (rendered, extracted)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_strict_none_without_hashes(text):
    if "####" not in text:
        assert extract_strict(text) is None
        assert score(text, "1")["format"] is False


@settings(max_examples=200, deadline=None)
@given(nums=st.lists(st.tuples(values, formats), min_size=1, max_size=6), words=prose)
def test_lenient_picks_last_number(nums, words):
    text = " ".join(f"{words} {render(v, f)}" for v, f in nums) + f" {words}"
    assert numbers_equal(extract_lenient(text), str(nums[-1][0]))


# ---------------------------------------------------------------- the recipe


def test_gsm8k_grpo_runs_its_recipe_and_other_tasks_keep_the_algo_defaults():
    """`python harness.py task=gsm8k algo=grpo` is the sweep's winner (task.recipe); overrides still win."""
    from helpers import compose_cfg
    from omegaconf import OmegaConf

    def algo(*overrides):
        return OmegaConf.to_container(compose_cfg(overrides), resolve=True)["algo"]

    gsm8k = algo("task=gsm8k", "algo=grpo")
    assert (gsm8k["warmup"]["steps"], gsm8k["steps"], gsm8k["eval_every"]) == (20, 8, 0)
    assert not gsm8k["dynamic_sampling"]
    assert gsm8k["warmup"]["lr"] == 2e-4 and gsm8k["warmup"]["split"] == "train"
    guess = algo("task=guess_number", "algo=grpo")  # issue 52's pilots: 2e-4 collapsed it, 10 steps did not move it
    assert (guess["warmup"]["steps"], guess["steps"], guess["lr"], guess["temperature"]) == (30, 20, 5e-5, 1.0)
    assert guess["warmup"]["lr"] == 2e-4 and not guess["dynamic_sampling"]
    hello = algo("task=hello", "algo=grpo")
    assert (hello["warmup"]["steps"], hello["steps"], hello["eval_every"]) == (0, 30, 15)
    overridden = algo("task=gsm8k", "algo=grpo", "algo.warmup.steps=0", "algo.steps=3")
    assert (overridden["warmup"]["steps"], overridden["steps"]) == (0, 3)


def test_the_default_jobs_end_evals_are_a_fixed_seeded_subset_of_the_test_set():
    """task.final_eval_size=561 (RESULTS.md "How many problems the evals need"): the periodic slice, then a seeded
    choice spread over the rest of the test set, the same in every run; 0 gives the whole test set."""
    from helpers import typed_cfg

    from agl.eval.evaluate import end_eval_rows

    def end_rows(*overrides):
        task = typed_cfg(["task=gsm8k", "algo=grpo", *overrides]).task
        return end_eval_rows(load_split("test"), task.eval_size, task.final_eval_size, task.final_eval_seed)

    test = load_split("test")
    rows = end_rows()
    assert len(rows) == 561 and rows[:100] == test[:100] and rows == end_rows()
    beyond = [test.index(r) for r in rows[100:]]
    assert min(beyond) < 200 and max(beyond) > 1200  # spread over the split, not its first 561
    assert end_rows("task.final_eval_seed=1") != rows
    assert end_rows("task.final_eval_size=0") == test
