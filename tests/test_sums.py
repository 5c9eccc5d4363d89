"""The first-run task (tasks/sums): its splits, its answers, its demonstrations and its recipe."""

import doctest
from pathlib import Path

from helpers import typed_cfg

import tasks.sums.agent
from tasks.sums.agent import bare_answer, demonstrations, load, reward


def test_the_splits_are_every_pair_once_and_the_answers_are_sums():
    train, test = load("train"), load("test")
    assert (len(train), len(test)) == (700, 200)
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    for row in train + test:
        a, b = (int(x) for x in row["question"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert row["answer"] == a + b
    assert load("test") == test  # seeded: the same problems in every run (and eval cache rows)


def test_a_demonstration_replies_with_what_the_reward_takes():
    prompt = "{question} Reply with the number only."
    for conversation, row in zip(demonstrations("train", prompt_template=prompt), load("train")):
        assert conversation[0]["content"] == prompt.format(question=row["question"])
        assert bare_answer(conversation[1]["content"]) == str(row["answer"])
    assert bare_answer("The sum is 42.") is None and bare_answer("42.") == "42"


def test_make_demo_runs_the_recipe_with_a_paired_eval_of_all_200():
    config = typed_cfg(["task=sums", "algo=grpo"])
    assert (config.algo.warmup.steps, config.algo.steps, config.algo.eval_every) == (6, 6, 0)
    assert (config.algo.batch_size, config.algo.dynamic_sampling, config.algo.max_extra_groups) == (8, True, 8)
    assert (config.algo.lr, config.algo.temperature, config.algo.gradient_checkpointing) == (3e-4, 1.0, False)
    assert (config.task.eval_size, config.task.final_eval_size) == (50, 0)
    assert "task=sums algo=grpo" in (Path(__file__).resolve().parents[1] / "Makefile").read_text()


def test_the_reward_is_the_sum_alone_and_a_lone_wrong_number_gets_the_format_bonus():
    assert [reward(text, 42) for text in ("42", " 42.\n", "41", "The sum is 42.")] == [1.0, 1.0, 0.0, 0.0]
    assert [reward(text, 42, format_bonus=0.1) for text in ("42", "41", "17 + 25 = 42")] == [1.0, 0.1, 0.0]
    result = doctest.testmod(tasks.sums.agent)
    assert result.attempted > 0 and result.failed == 0
