"""Twenty questions and the route's frozen helper models (``server.frozen_models``)."""

from __future__ import annotations

import json
import sqlite3

import openai
import pytest
import torch

import agl
from agl.policy.engine import Engine
from agl.policy.load import load_policy
from agl.route.server import ModelServer
from agl.store import SqliteStore
from agl.train.samples import spans_to_samples
from tasks.q20.agent import FIRST, demonstrations, guessed, is_secret, load, search
from tasks.q20.nouns import NOUNS

USER = [{"role": "user", "content": "Is it an animal?"}]


def test_guesses_name_one_thing_and_the_splits_never_share_a_secret():
    assert guessed("Is it a penguin?") == "penguin" and guessed("is it an owl") == "owl"
    for not_a_guess in (
        "Is it a cat or a dog?",
        "Is it a cat, a dog, a cow?",
        "Does it fly?",
        "Is it a big cat?",
        "I think it is a cat",
    ):
        assert guessed(not_a_guess) is None, not_a_guess
    assert is_secret("cats", "cat") and is_secret("foxes", "fox") and not is_secret("cow", "crow")
    train, test = load("train"), load("test")
    assert len(train) == 120 and len(test) == 40
    assert not {r["answer"] for r in train} & {r["answer"] for r in test}
    assert sum(len(v) for v in NOUNS.values()) == 160 == len({n for v in NOUNS.values() for n in v})  # no noun twice
    assert "cat" in search("what animals are there?") and search("xyz") == "No results."


def test_demonstrations_guess_train_nouns_until_the_secret():
    test_nouns = {r["answer"] for r in load("test")}
    for game, row in zip(demonstrations("train"), load("train")):
        assert game[1] == {"role": "user", "content": FIRST} and row["category"] in game[0]["content"]
        asked = [guessed(m["content"]) for m in game if m["role"] == "assistant"]
        assert asked[-1] == row["answer"] and None not in asked and len(asked) <= 20
        assert not set(asked) & test_nouns
        assert all(m["content"] == "No." for m in game[2:] if m["role"] == "user")


@pytest.fixture
async def route(tiny_model_cfg, tmp_path):
    """The policy with a trained-looking (random, non-zero) LoRA, served with a frozen ``base``."""
    policy = load_policy(tiny_model_cfg, "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    engine, frozen = Engine(policy), Engine(policy, adapter=False)
    store = SqliteStore(tmp_path / "store.sqlite")
    await store.__aenter__()
    server = ModelServer(engine, policy, store, frozen={"base": frozen})
    for part in (engine, frozen, server):
        await part.start()
    yield policy, store, server
    for part in (server, engine, frozen):
        await part.stop()
    await store.close()


def response_logprobs(model, span) -> torch.Tensor:
    ids = span.prompt_token_ids + span.response_token_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, len(span.prompt_token_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(span.response_token_ids)[:, None])[:, 0]


async def test_a_frozen_model_is_the_base_model_recorded_but_never_trained(route):
    policy, store, server = route
    attempted = await store.start_rollout(input={"task": "q20"})
    rid, aid = attempted.rollout_id, attempted.attempt.attempt_id
    client = openai.AsyncOpenAI(base_url=server.rollout_base_url(rid, aid), api_key="unused", max_retries=0)
    mine = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0)
    helper = await client.chat.completions.create(model="base", messages=USER, max_tokens=6, temperature=0)
    assert (mine.model, helper.model) == ("tiny", "base")

    policy_span, base_span = sorted(await store.query_spans(rid, aid), key=lambda s: s.sequence_id)
    assert policy_span.attributes["trainable"] is True and policy_span.attributes["model"] == "tiny"
    assert base_span.attributes["trainable"] is False and base_span.attributes["model"] == "base"
    assert base_span.attributes["policy_version"] is None
    with policy.reference():  # what the frozen model recorded is the base model's distribution ...
        reference = response_logprobs(policy.model, base_span)
    torch.testing.assert_close(torch.tensor(base_span.response_logprobs), reference, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(response_logprobs(policy.model, base_span), reference, atol=1e-2)  # ... not the policy's

    [sample] = spans_to_samples(await store.query_spans(rid, aid), reward=1.0)
    assert sample.prompt_ids == policy_span.prompt_token_ids and sample.completion_ids == policy_span.response_token_ids

    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="judge", messages=USER, max_tokens=2)
    assert "tiny" in str(missing.value) and "base" in str(missing.value)
    assert [m.id for m in (await client.models.list()).data] == ["tiny", "base"]


def test_q20_trains_on_the_players_turns_only(tmp_path):
    """The whole job on the tiny model (harness.py's, in this process): every answerer call is recorded, frozen
    and out of the samples. The task's recipe starts with an SFT warm-up on its demonstrations (30 steps): here
    one step of 2 games, then one GRPO step."""
    agl.run(
        "model=tiny",
        "task=q20",
        "algo=grpo",
        "algo.steps=1",
        "algo.batch_size=2",
        "algo.group_size=2",
        "algo.eval_every=0",
        "task.eval_size=2",
        "task.resources.max_turns=3",
        "task.max_tokens=8",
        "algo.drop_zero_std=false",
        "algo.warmup.steps=1",
        "algo.warmup.batch_size=2",
        "progress=false",
        run_dir=tmp_path / "run",
    )
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line.get("stage")) for line in lines] == [(-1, None), (0, "sft"), (1, "grpo")]
    db = sqlite3.connect(tmp_path / "run" / "store.sqlite")
    models = [json.loads(a).get("model") for (a,) in db.execute("SELECT attributes FROM spans WHERE name = 'llm.chat'")]
    assert "base" in models and "tiny" in models
    frozen = [
        json.loads(a)["trainable"]
        for (a,) in db.execute("SELECT attributes FROM spans WHERE name = 'llm.chat'")
        if json.loads(a).get("model") == "base"
    ]
    assert frozen and not any(frozen)

    agl.run(f"report={tmp_path / 'run'}")  # its samples show the player's replies, not the answerer's
    first_eval = db.execute(
        "SELECT rollout_id FROM rollouts WHERE json_extract(metadata, '$.eval_step') IS NOT NULL ORDER BY seq LIMIT 1"
    ).fetchone()[0]
    replies = [
        json.loads(a)
        for (a,) in db.execute(
            "SELECT attributes FROM spans WHERE rollout_id = ? AND name = 'llm.chat' ORDER BY sequence_id",
            (first_eval,),
        )
    ]
    player = [r["response_text"] for r in replies if r["trainable"]]
    shown = "\n".join("> " + line for line in (player[-1] or "(no reply)").splitlines())  # as report.md quotes a reply
    assert f"\n{shown}\n" in (tmp_path / "run" / "report.md").read_text()
