"""The guess-number task's demonstrations: binary search, played by the agent's own rules."""

import doctest

import tasks.guess_number.agent
from agl.policy.load import load_policy
from agl.train.sft import render_demonstration
from tasks.guess_number.agent import FIRST, SYSTEM, demonstrations, feedback, load, reward


def test_demonstrations_are_binary_search_games_with_the_agents_feedback():
    games, rows = demonstrations("train"), load("train")
    assert len(games) == len(rows) == 512
    for game, row in zip(games, rows):
        assert game[:2] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
        turns = game[2:]
        assert [m["role"] for m in turns] == ["assistant", "user"] * (len(turns) // 2) + ["assistant"]
        guesses = [int(m["content"]) for m in turns if m["role"] == "assistant"]
        lo, hi = 1, 100
        for guess, reply in zip(guesses, [m["content"] for m in turns if m["role"] == "user"]):
            assert guess == (lo + hi) // 2 and reply == feedback(guess, row["secret"])
            lo, hi = (guess + 1, hi) if guess < row["secret"] else (lo, guess - 1)
        assert len(guesses) <= 6
        assert (guesses[-1] == row["secret"]) or len(guesses) == 6  # won, or out of turns
    won = sum(game[-1]["content"] == str(row["secret"]) for game, row in zip(games, rows))
    assert 0.55 < won / len(games) < 0.75  # 63 of the 100 numbers are found within 6 halvings


def test_every_guess_is_learned_and_nothing_else(tiny_model_cfg):
    policy = load_policy(tiny_model_cfg, "cpu")
    game = demonstrations("test", max_turns=3)[1]
    ids, mask = render_demonstration(policy, game)
    learned = policy.tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert learned == "<|im_end|>".join(m["content"] for m in game if m["role"] == "assistant") + "<|im_end|>"


def test_the_search_bonus_ranks_lost_games_by_what_their_guesses_ruled_out():
    games, rows = demonstrations("train"), load("train")
    guessed = [[int(m["content"]) for m in game[2:] if m["role"] == "assistant"] for game in games]
    played = [(guesses, row["secret"]) for guesses, row in zip(guessed, rows)]
    assert {reward(guesses, secret) for guesses, secret in played} == {0.0, 1.0}  # no bonus: the 0/1 reward
    for guesses, secret in played:
        scored = reward(guesses, secret, search_bonus=0.5)
        assert scored == 1.0 if guesses[-1] == secret else 0.4 < scored <= 0.5  # 6 halvings leave 1-2 numbers
        if guesses[-1] != secret:  # the same number of turns spent repeating the first guess rules out less
            assert reward([guesses[0]] * len(guesses), secret, search_bonus=0.5) < scored
    assert reward([], 37, search_bonus=0.5) == reward([101, -5], 37, search_bonus=0.5) == 0.0  # nothing ruled out
    result = doctest.testmod(tasks.guess_number.agent)
    assert result.attempted > 0 and result.failed == 0
