"""Twenty questions played by a CrewAI flow (tasks/q20/crewai_agent.py) through the real route.

CrewAI is an optional extra (`.[crewai]`, in a venv of its own: it pins openai<3 and pydantic<2.13;
`make test-crewai`). These tests skip where it is not installed, unless AGL_REQUIRE_FRAMEWORKS names
`crewai` (then a missing CrewAI fails), as tests/test_frameworks.py does.

On the tiny random model every reply is scripted (test_server's forced_tokens: a hook on the output
layer, which the frozen `base` engine shares with the policy's), so the test knows each call's
token ids: the player's questions, the answerer's Yes, a search tool call. One `slow` test plays a
game on the embedded SmolLM2-135M, greedy, with the models' own replies.
"""

import importlib
import json
import os
import sqlite3

import pytest
import torch
from omegaconf import OmegaConf
from test_server import EOS, Served, chosen_tokens, forced_tokens

import agl
from agl.agents.api import RolloutContext, call_agent
from agl.policy.engine import Engine
from agl.policy.load import load_policy
from agl.route.rendering import decode
from agl.route.server import ModelServer
from agl.store import SqliteStore
from agl.train.samples import spans_to_samples

if "crewai" in os.environ.get("AGL_REQUIRE_FRAMEWORKS", "").split():
    importlib.import_module("crewai")  # required here: missing fails, not skips
else:
    pytest.importorskip("crewai")

from tasks.q20.agent import ANSWERER, FIRST, SYSTEM, guessed, verdict  # noqa: E402
from tasks.q20.crewai_agent import play, q20_crewai_agent  # noqa: E402

CAT = {"id": "animal-cat", "category": "animal", "answer": "cat"}
SAMPLING = {"temperature": 1.0, "max_tokens": 24}


class ServedWithBase(Served):
    """test_server's route on the tiny policy, with the frozen `base` model as well (server.frozen_models),
    and (``perturb``) a random non-zero LoRA so that policy and base differ."""

    def __init__(self, cfg, store_path, perturb=True):
        self.perturb = perturb
        super().__init__(cfg, store_path)

    async def _start(self, cfg, store_path, device):
        self.policy = load_policy(cfg, device)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.policy.trainable_parameters() if self.perturb else ():
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
        self.engine, self.frozen = Engine(self.policy), Engine(self.policy, adapter=False)
        self.store = SqliteStore(store_path)
        await self.store.__aenter__()
        self.server = ModelServer(self.engine, self.policy, self.store, frozen={"base": self.frozen})
        for part in (self.engine, self.frozen, self.server):
            await part.start()

    def close(self):
        self.call(self.frozen.stop())
        super().close()


@pytest.fixture(scope="module")
def route(tiny_model_cfg, tmp_path_factory):
    served = ServedWithBase(tiny_model_cfg, tmp_path_factory.mktemp("q20-crewai") / "store.sqlite")
    yield served
    served.close()


def llm_of(served, rid, aid, sampling=SAMPLING) -> agl.LLM:
    return agl.LLM(
        base_url=served.server.rollout_base_url(rid, aid), model=served.policy.name, sampling_parameters=sampling
    )


def chat_spans(served, rid, aid) -> list:
    return sorted((s for s in served.spans(rid, aid) if s.name == "llm.chat"), key=lambda s: s.sequence_id)


def reply_text(served, span) -> str:
    ids = span.response_token_ids
    return decode(served.policy.tokenizer, ids[:-1] if ids and ids[-1] == EOS else ids)


def check_player(served, spans, messages, reward):
    """The player's spans are CrewAI's replies (the assistant messages of the game), each prompt
    extends the previous one exactly, and they merge into one training sample; the answerer's
    spans are recorded, frozen, and left out of it."""
    player = [s for s in spans if s.attributes["model"] == served.policy.name]
    frozen = [s for s in spans if s.attributes["model"] == "base"]
    assert len(player) + len(frozen) == len(spans)
    assert all(s.attributes["trainable"] is True for s in player)
    assert all(s.attributes["trainable"] is False and s.attributes["policy_version"] is None for s in frozen)
    said = [m for m in messages if m["role"] == "assistant"]
    assert len(said) == len(player)
    for span, message in zip(player, said):
        if message.get("tool_calls"):
            calls = [
                (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in span.attributes["tool_calls"]
            ]
            assert calls == [
                (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
            ]
        else:
            assert reply_text(served, span) == message["content"] and not span.attributes["tool_calls"]
    assert (
        player[0].attributes["request"]["messages"] == messages[:2]
    )  # the system prompt and FIRST, as CrewAI sent them
    for before, after in zip(player, player[1:]):
        exact = before.prompt_token_ids + before.response_token_ids
        assert after.prompt_token_ids[: len(exact)] == exact, "a later question does not extend the earlier one exactly"
    [sample] = spans_to_samples(spans, reward=reward)
    assert sample.reward == reward and sample.prompt_ids == player[0].prompt_token_ids
    assert sample.prompt_ids + sample.completion_ids == player[-1].prompt_token_ids + player[-1].response_token_ids
    sampled = [t for t, m in zip(sample.completion_ids, sample.mask) if m]
    # the player's tokens only, no answerer's; none a grammar forced (a required tool call's frame)
    assert sampled == [t for s in player for t in chosen_tokens(s)]
    return player, frozen


def test_a_won_game_is_the_players_turns_in_one_sample(route):
    """Does it purr? (answerer: Yes)  Is it a dog? (game: No)  Is it a cat? (won): reward 1."""
    tok = route.policy.tokenizer
    script = ["Does it purr?", " Yes", "Is it a dog?", "Is it a cat?"]
    rid, aid = route.new_attempt()
    with forced_tokens(route, *(tok.encode(s) for s in script)) as state:
        game = play(CAT, llm_of(route, rid, aid), max_turns=5)
    assert state["call"] == 4  # three questions and one answer; the wrong guess never reached the answerer
    assert game.won and game.questions == 3
    spans = chat_spans(route, rid, aid)
    assert [s.attributes["model"] for s in spans] == ["tiny", "base", "tiny", "tiny"]
    assert [m["content"] for m in game.messages[2:]] == ["Does it purr?", "Yes.", "Is it a dog?", "No.", "Is it a cat?"]
    player, [answerer] = check_player(route, spans, game.messages, 1.0)
    assert answerer.response_token_ids == tok.encode(" Yes") + [EOS] and reply_text(route, answerer) == " Yes"
    assert answerer.attributes["request"]["messages"] == [
        {"role": "system", "content": ANSWERER.format(answer="cat", category="animal")},
        {"role": "user", "content": "Does it purr?"},
    ]
    assert (
        answerer.attributes["request"]["sampling"]["max_tokens"] == 3
        and answerer.attributes["request"]["sampling"]["temperature"] == 0
    )
    assert player[0].attributes["request"]["messages"][0]["content"] == SYSTEM.format(category="animal")
    assert player[1].attributes["request"]["messages"][-1] == {
        "role": "user",
        "content": "Yes.",
    }  # the answer reached the player
    assert player[2].attributes["request"]["messages"][-1] == {"role": "user", "content": "No."}
    assert (
        player[0].attributes["request"]["sampling"]["max_tokens"] == 24
        and player[0].attributes["request"]["sampling"]["temperature"] == 1.0
    )


def test_a_lost_game_through_the_runner_scores_zero(route):
    """Run as the runner runs it (call_agent, in a worker thread, with emit_metric): no right guess
    within max_turns is reward 0 and `questions` = max_turns; an answerer's No reaches the player."""
    tok = route.policy.tokenizer
    rid, aid = route.new_attempt()
    context = RolloutContext(route.store, rid, aid, route.loop)
    with forced_tokens(route, tok.encode("Does it fly?"), tok.encode("No"), tok.encode("Is it a cow?")) as state:
        reward = route.call(call_agent(q20_crewai_agent, context, CAT, llm_of(route, rid, aid), {"max_turns": 2}))
    assert reward == 0.0 and state["call"] == 3
    spans = chat_spans(route, rid, aid)
    assert [s.attributes["model"] for s in spans] == ["tiny", "base", "tiny"]
    messages = spans[-1].attributes["request"]["messages"] + [{"role": "assistant", "content": "Is it a cow?"}]
    assert [m["content"] for m in messages[1:]] == [FIRST, "Does it fly?", "No.", "Is it a cow?"]
    check_player(route, spans, messages, 0.0)
    [metric] = [s for s in route.spans(rid, aid) if s.name == "metric"]
    assert metric.attributes == {"name": "questions", "value": 2.0}


def test_search_is_a_tool_call_crewai_hands_back(route):
    """search_tool: the player calls `search` (scripted), the flow runs it and sends the result as a
    tool message, the player guesses right: one sample across the tool call."""
    tok = route.policy.tokenizer
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "animals"}}\n</tool_call>'
    rid, aid = route.new_attempt()
    with forced_tokens(route, tok.encode(call), tok.encode("Is it a cat?")):
        game = play(CAT, llm_of(route, rid, aid, {"temperature": 1.0, "max_tokens": 48}), max_turns=3, search_tool=True)
    assert game.won and game.questions == 2
    spans = chat_spans(route, rid, aid)
    assert [s.attributes["model"] for s in spans] == ["tiny", "tiny"]
    assert (
        spans[0].attributes["finish_reason"] == "tool_calls"
        and spans[0].attributes["chat_template"] == "agl-hermes-tools"
    )
    assert [t["function"]["name"] for t in spans[0].attributes["request"]["tools"]] == ["search"]
    tool = spans[1].attributes["request"]["messages"][-1]
    assert tool["role"] == "tool" and "Common animals: " in tool["content"] and "cat" in tool["content"]
    assert tool["tool_call_id"] == game.messages[2]["tool_calls"][0]["id"]
    check_player(route, spans, game.messages, 1.0)


def test_text_before_a_tool_call_is_lost_and_splits_the_sample(route):
    """A known limit, pinned: CrewAI's LLM.call returns only the tool calls of a reply, not the text
    before them, so the conversation it builds no longer holds what the model wrote; the next prompt
    extends the call's prompt but not its response, and the rollout is two samples, not one (the
    openai version keeps the text: one sample). If a CrewAI release keeps it, this fails: then one."""
    tok = route.policy.tokenizer
    call = 'Let me search.\n<tool_call>\n{"name": "search", "arguments": {"query": "animals"}}\n</tool_call>'
    rid, aid = route.new_attempt()
    with forced_tokens(route, tok.encode(call), tok.encode("Is it a cat?")):
        game = play(CAT, llm_of(route, rid, aid, {"temperature": 1.0, "max_tokens": 64}), max_turns=3, search_tool=True)
    assert game.won and game.messages[2]["content"] is None and game.messages[2]["tool_calls"]
    first, second = chat_spans(route, rid, aid)
    assert second.attributes["prompt_reused_tokens"] == len(first.prompt_token_ids)  # the prompt, not the reply
    assert len(spans_to_samples([first, second], reward=1.0)) == 2


def test_q20_crewai_through_the_harness(tmp_path):
    """`task.agent=tasks.q20.crewai_agent:q20_crewai_agent` selects it: an eval job (the runners and
    route that training uses, without the GRPO step, which test_q20.py covers) on two games. The job harness.py
    runs, here in this process (agl.run): a harness process of its own would import torch and CrewAI again."""
    agl.run(
        "model=tiny",
        "task=q20",
        "task.agent=tasks.q20.crewai_agent:q20_crewai_agent",
        "algo=eval",
        "task.eval_size=2",
        "task.resources.max_turns=3",
        "task.max_tokens=8",
        run_dir=tmp_path / "run",
    )
    db = sqlite3.connect(tmp_path / "run" / "store.sqlite")
    calls = [json.loads(a) for (a,) in db.execute("SELECT attributes FROM spans WHERE name = 'llm.chat'")]
    assert {c["model"] for c in calls} == {"tiny", "base"}
    assert all(c["trainable"] is (c["model"] == "tiny") for c in calls)
    metrics = [json.loads(a) for (a,) in db.execute("SELECT attributes FROM spans WHERE name = 'metric'")]
    assert len(metrics) == 2 and all(m["name"] == "questions" and 1 <= m["value"] <= 3 for m in metrics)


# ----------------------------------------------------------------------------- the embedded model


@pytest.mark.slow
def test_embedded_model_plays_a_game(tmp_path):
    """SmolLM2-135M-Instruct, greedy: its own questions, the frozen base model's answers."""
    from helpers import compose_cfg

    cfg = compose_cfg()
    served = ServedWithBase(
        OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True)), tmp_path / "store.sqlite", perturb=False
    )
    try:
        rid, aid = served.new_attempt()
        game = play(CAT, llm_of(served, rid, aid, {"temperature": 0.0, "max_tokens": 16}), max_turns=2)
        spans = chat_spans(served, rid, aid)
        assert all(
            m["content"].strip() for m in game.messages if m["role"] == "assistant"
        )  # it asked something, each time
        assert game.questions == 2 or game.won
        player, frozen = check_player(served, spans, game.messages, float(game.won))
        answers = iter(frozen)  # the answerer's own replies; a guess hears "No." from the game instead
        for question, heard in zip(game.messages[2::2], game.messages[3::2]):
            assert heard["content"] == (
                "No." if guessed(question["content"]) else verdict(reply_text(served, next(answers)))
            )
        assert next(answers, None) is None
    finally:
        served.close()
