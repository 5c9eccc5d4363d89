"""Agents written with LangChain, LiteLLM, pydantic-ai and the OpenAI Agents SDK
(tests/framework_agents.py) run unchanged through the real route: chat, streaming, multi-turn
and tool calls, each checked against the spans the route recorded (exact token ids) and the
training sample they merge into.

Each framework is an optional extra; its tests skip where it is not installed, unless
AGL_REQUIRE_FRAMEWORKS names it (then a missing framework fails). LiteLLM needs `openai<3`,
pydantic-ai's OpenAI models and openai-agents need `openai>=3`, langchain-openai takes either: no
one venv holds all four, so this file is meant to run twice, in a venv with openai 3
(`.[frameworks]`: LangChain, pydantic-ai, openai-agents) and in one with openai 2 (`.[litellm]`:
LiteLLM and LangChain).

On the tiny random model the replies are scripted (a hook on the output layer makes the model
write the given tokens): the test knows the exact ids each call must record. One `slow` test per
framework runs on the embedded SmolLM2-135M with greedy decoding: there the tool call is scripted
(135M does not call tools on its own) and every other reply is the model's own.
"""

import asyncio
import importlib
import inspect
import json
import os

import framework_agents
import pytest
from omegaconf import OmegaConf
from test_server import EOS, Served, chosen_tokens, forced_tokens, served  # noqa: F401  (served: the route on the tiny policy)

import agl
from agl.route.rendering import decode
from agl.train.samples import spans_to_samples

QUESTION = "What is 1 + 2?"
# Scripted replies: a leading space, a double space, accents, an emoji, a newline: text a framework
# might be tempted to normalise, and that must come back (and be recorded) exactly.
SAY = " Héllo,  wörld! 1 + 2 = 3 🙂\nDone."
SAY_AGAIN = "It is 3, still."
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
ANSWER = "The sum is 3."
# litellm 1.106's pydantic types warn at import; nothing agl can act on
pytestmark = pytest.mark.filterwarnings("ignore:Item 'summary' on TypedDict class:UserWarning")

# name -> (module that must import, agent-name prefix in framework_agents, keyword arguments)
FRAMEWORKS = {
    "langchain": ("langchain_openai", "langchain", {}),
    "langchain-responses": ("langchain_openai", "langchain", {"responses": True}),
    "litellm": ("litellm", "litellm", {}),
    "pydantic-ai": ("pydantic_ai.models.openai", "pydantic_ai", {}),
    "pydantic-ai-responses": ("pydantic_ai.models.openai", "pydantic_ai", {"responses": True}),
    "openai-agents": ("agents", "openai_agents", {"responses": True}),  # the SDK's default model
    "openai-agents-chat": ("agents", "openai_agents", {"responses": False}),  # OpenAIChatCompletionsModel
}


# Frameworks that must be installed (space-separated names of FRAMEWORKS), so that a venv built
# to test them fails instead of skipping when one is missing: the Makefile sets it.
REQUIRED = os.environ.get("AGL_REQUIRE_FRAMEWORKS", "").split()


def framework(name: str, kind: str):
    """(agent function, its keyword arguments); skips when the framework is not installed."""
    module, prefix, kwargs = FRAMEWORKS[name]
    if name in REQUIRED:
        importlib.import_module(module)
    else:
        pytest.importorskip(module)
    return getattr(framework_agents, f"{prefix}_{kind}"), kwargs


def scripted(served, *scripts):
    """Call i writes ``scripts[i]`` (token ids), then eos; once the scripts are used up the model
    writes what it likes."""
    return forced_tokens(served, *scripts, then_free=True)


def run(served, agent, sampling: dict, **kwargs):
    """Run an agent on a fresh rollout attempt's route, as the runner does: (reward, transcript, spans)."""
    rid, aid = served.new_attempt()
    llm = agl.LLM(
        base_url=served.server.rollout_base_url(rid, aid), model=served.policy.name, sampling_parameters=sampling
    )
    transcript: list[dict] = []
    reward = agent({"id": "t0", "question": QUESTION}, llm, transcript=transcript, **kwargs)
    if inspect.iscoroutine(reward):
        reward = asyncio.run(reward)
    return reward, transcript, served.spans(rid, aid)


def reply_ids(span) -> list[int]:
    ids = span.response_token_ids
    return ids[:-1] if ids and ids[-1] == EOS else ids


def calls_of(span) -> list:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in span.attributes["tool_calls"] or []
    ]


def check(served, spans, transcript, reward, tools=False):
    """Every reply the framework returned is a recorded span whose response ids decode to it (or
    parse to its tool calls); each call's prompt starts with the previous call's exact prompt and
    response; the whole conversation is one training sample with loss on the sampled ids only."""
    tok = served.policy.tokenizer
    assert len(spans) == len(transcript), (transcript, [s.attributes["response_text"] for s in spans])
    for span, said in zip(spans, transcript):
        assert span.name == "llm.chat" and span.attributes["model"] == served.policy.name
        assert len(span.response_logprobs) == len(span.response_token_ids) > 0
        if "calls" in said:
            assert calls_of(span) == said["calls"] and span.attributes["finish_reason"] == "tool_calls"
        else:
            assert decode(tok, reply_ids(span)) == said["text"] and not span.attributes["tool_calls"]
        assert span.attributes["chat_template"] == ("agl-hermes-tools" if tools else "model")
    first = spans[0]
    messages = first.attributes["request"]["messages"]
    assert messages[-1] == {"role": "user", "content": QUESTION}
    if tools:
        assert [t["function"]["name"] for t in first.attributes["request"]["tools"]] == ["add"]
        assert '"name": "add"' in decode(tok, first.prompt_token_ids) and "<tool_call>" in decode(
            tok, first.prompt_token_ids
        )
    else:
        assert first.prompt_token_ids == served.policy.render_chat(messages)
    for before, after in zip(spans, spans[1:]):
        exact = before.prompt_token_ids + before.response_token_ids
        assert after.prompt_token_ids[: len(exact)] == exact, "a later call does not extend the earlier one exactly"
        assert after.attributes["prompt_reused_tokens"] == len(exact)
    [sample] = spans_to_samples(spans, reward=reward)
    assert sample.prompt_ids == first.prompt_token_ids and sample.reward == reward
    assert sample.prompt_ids + sample.completion_ids == spans[-1].prompt_token_ids + spans[-1].response_token_ids
    chosen = [chosen_tokens(s) for s in spans]  # loss on every sampled id, but those a grammar forced
    assert sample.num_sampled == sum(map(len, chosen)) == sum(sample.mask)
    sampled = [i for i, m in zip(sample.completion_ids, sample.mask) if m]
    assert sampled == [t for ids in chosen for t in ids]


# ----------------------------------------------------------------------------- the tiny model

TINY = {"temperature": 1.0, "max_tokens": 48}
names = pytest.mark.parametrize("name", list(FRAMEWORKS))


@names
def test_chat(served, name):
    agent, kwargs = framework(name, "chat")
    tok = served.policy.tokenizer
    with scripted(served, tok.encode(SAY)):
        reward, transcript, spans = run(served, agent, TINY, **kwargs)
    assert transcript == [{"text": SAY}] and reward == 1.0
    check(served, spans, transcript, reward)
    assert spans[0].response_token_ids == tok.encode(SAY) + [EOS]  # exactly the ids the model wrote
    assert spans[0].attributes["request"]["messages"][0]["content"] == "Be brief."  # the system prompt / instructions


@names
def test_stream(served, name):
    agent, kwargs = framework(name, "stream")
    tok = served.policy.tokenizer
    with scripted(served, tok.encode(SAY)):
        reward, transcript, spans = run(served, agent, TINY, **kwargs)
    [said] = transcript
    assert said["text"] == SAY and said["chunks"] > 3  # it streamed, in pieces
    check(served, spans, [said], reward)
    assert spans[0].response_token_ids == tok.encode(SAY) + [EOS]


@names
def test_multi_turn(served, name):
    agent, kwargs = framework(name, "multi_turn")
    tok = served.policy.tokenizer
    with scripted(served, tok.encode(SAY), tok.encode(SAY_AGAIN)):
        reward, transcript, spans = run(served, agent, TINY, **kwargs)
    assert transcript == [{"text": SAY}, {"text": SAY_AGAIN}] and reward == 1.0
    check(served, spans, transcript, reward)
    follow_up = spans[1].attributes["request"]["messages"]
    assert [m["role"] for m in follow_up][-3:] == ["user", "assistant", "user"] and follow_up[-1][
        "content"
    ] == framework_agents.FOLLOW_UP


@names
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_then_answer(served, name, stream):
    """The model calls add(1, 2) (scripted), the framework runs the tool and sends its result
    back, the model answers: two calls, one training sample."""
    agent, kwargs = framework(name, "tools")
    tok = served.policy.tokenizer
    with scripted(served, tok.encode(CALL), tok.encode(ANSWER)):
        reward, transcript, spans = run(served, agent, TINY, stream=stream, **kwargs)
    assert [{k: v for k, v in said.items() if k != "chunks"} for said in transcript] == [
        {"calls": [("add", {"a": 1, "b": 2})]},
        {"text": ANSWER},
    ]
    assert reward == 1.0
    if stream:
        assert all(said.get("chunks", 0) > 2 for said in transcript), transcript
    check(served, spans, transcript, reward, tools=True)
    assert spans[0].response_token_ids == tok.encode(CALL) + [EOS] and spans[1].response_token_ids == tok.encode(
        ANSWER
    ) + [EOS]
    result = tok.decode(spans[1].prompt_token_ids[len(spans[0].prompt_token_ids) + len(spans[0].response_token_ids) :])
    assert "<tool_response>\n3\n</tool_response>" in result  # the tool's result, as the framework sent it
    assert spans[1].attributes["request"]["messages"][-1]["role"] == "tool"


STRUCTURED = [name for name in FRAMEWORKS if not name.startswith("litellm")]


@pytest.mark.parametrize("name", STRUCTURED)
def test_structured_output(served, name):
    """The framework asks for a pydantic model (LangChain's with_structured_output, pydantic-ai's
    NativeOutput, the Agents SDK's output_type): the route enforces its JSON schema, so even the
    tiny random model's reply parses into it, and the span records the grammar it was sampled under."""
    agent, kwargs = framework(name, "structured")
    reward, transcript, spans = run(served, agent, TINY, **kwargs)
    [said] = transcript
    [span] = spans
    schema = span.attributes["request"]["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["unit"]["enum"] == ["apples", "pears"]
    assert span.attributes["constraint"]["kind"] == "json_schema" and span.attributes["finish_reason"] == "stop"
    assert json.loads(span.attributes["response_text"]) == said["parsed"]
    assert reward == float(said["parsed"]["answer"] == 3)


# ----------------------------------------------------------------------------- the embedded model

GREEDY = {"temperature": 0.0, "max_tokens": 64}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The route on the embedded SmolLM2-135M-Instruct (conf/model/smollm2.yaml, as composed)."""
    from helpers import compose_cfg

    cfg = compose_cfg()
    served = Served(
        OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True)),
        tmp_path_factory.mktemp("embedded") / "store.sqlite",
    )
    yield served
    served.close()


def test_required_frameworks_are_known():
    assert set(REQUIRED) <= set(FRAMEWORKS), (
        f"AGL_REQUIRE_FRAMEWORKS names unknown frameworks: {set(REQUIRED) - set(FRAMEWORKS)}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["langchain", "litellm", "pydantic-ai", "openai-agents"])
def test_embedded_model(embedded, name):
    """The model's own greedy replies: a multi-turn chat, then a tool call (scripted) whose
    result the model answers, streamed."""
    chat, kwargs = framework(name, "multi_turn")
    tools, _ = framework(name, "tools")
    tok = embedded.policy.tokenizer
    reward, transcript, spans = run(embedded, chat, GREEDY, **kwargs)
    assert all(said["text"].strip() for said in transcript), transcript  # it wrote something, both times
    check(embedded, spans, transcript, reward)

    with scripted(embedded, tok.encode(CALL)) as state:
        reward, transcript, spans = run(embedded, tools, GREEDY, stream=True, **kwargs)
    assert state["call"] == 1  # the call was scripted, the answer not
    assert transcript[0]["calls"] == [("add", {"a": 1, "b": 2})] and "text" in transcript[-1]
    check(embedded, spans, transcript, reward, tools=True)
