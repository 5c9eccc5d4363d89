"""The guess-number task's demonstrations: binary search, played by the agent's own rules."""

from agl.policy.load import load_policy
from agl.train.sft import render_demonstration
from tasks.guess_number.agent import FIRST, SYSTEM, demonstrations, feedback, load


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
