"""Structured outputs through the real route on the tiny model (docs/structured-outputs.md):
``response_format`` and ``text.format`` replies, forced, strict and single tool calls, the 400s for
what cannot be enforced, and the trainer's replayed masks agreeing with the sampler's log-probs.

The tiny model's weights are random, so what it writes under a grammar is close to a uniform draw
among the tokens the grammar allows: a stern test of the grammar (it never writes what a trained
model would), and why the schemas here bound their strings and numbers (so replies end).
"""

import json

import jsonschema
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from test_server import MODEL, USER, forced_tokens, served  # noqa: F401  (served: the route on the tiny policy)

from agl.config import GRPOConfig
from agl.policy.grammar import Grammar, GrammarState, policy_grammar_tokenizer, replay
from agl.train.forward import completion_logprobs
from agl.train.grpo import GRPOUpdate
from agl.train.micro_batches import grammar_masks
from agl.train.samples import spans_to_samples
from agl.train.token_batch import TokenBatch

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": DIGIT, "b": DIGIT},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
FLAG = {
    "type": "function",
    "function": {
        "name": "flag",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}},
            "required": ["on"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (ADD, FLAG)}


class Weather(BaseModel):
    city: str = Field(max_length=3)
    degrees: int = Field(ge=-9, le=40)
    sky: str = Field(pattern="^(sun|rain)$")


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": strict}}


def test_parse_with_a_pydantic_model_returns_the_model(served):
    """The OpenAI SDK's ``chat.completions.parse``: a strict json_schema from the pydantic model."""
    completion = served.client().chat.completions.parse(
        model=MODEL, messages=USER, response_format=Weather, max_tokens=60, seed=3, n=3
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Weather) and choice.message.parsed.sky in ("sun", "rain")


def test_json_object_and_non_strict_schemas_are_enforced_too(served):
    tok = served.policy.tokenizer
    client = served.client()
    for script, check in (
        ('{"x": [1, 2]}', lambda text: text == '{"x": [1, 2]}'),  # valid: written as scripted
        ("Sure! Here it is.", lambda text: text.startswith("{")),  # not JSON: the grammar overrules the script
    ):
        with forced_tokens(served, tok.encode(script)):
            reply = client.chat.completions.create(
                model=MODEL, messages=USER, response_format={"type": "json_object"}, max_tokens=12
            )
        assert check(reply.choices[0].message.content), reply.choices[0]
    schema = {"enum": ["yes", "no", 1]}
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, response_format=json_schema_format(schema, strict=False), max_tokens=10, n=4
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and json.loads(choice.message.content) in schema["enum"]


@pytest.mark.parametrize("parallel", [None, False])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_forced_tool_calls_parse_and_validate(served, choice, parallel):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = served.client().chat.completions.create(
        model=MODEL, messages=USER, tools=[ADD, FLAG], tool_choice=tool_choice, max_tokens=60, seed=7, n=4, **extra
    )
    for c in reply.choices:
        calls = c.message.tool_calls
        assert calls and c.finish_reason in ("tool_calls", "length")
        complete = calls if c.finish_reason == "tool_calls" else calls[:-1]  # "length": the last one was cut
        for call in complete:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if choice == "add":
            assert {call.function.name for call in calls} == {"add"}
        if parallel is False:
            assert len(calls) == 1 and c.finish_reason == "tool_calls"  # one short call always fits in 60 tokens


def test_a_strict_tool_under_auto_corrects_a_malformed_call(served):
    """The model is scripted to write a call with a wrong argument name and a number out of range;
    the grammar of a strict tool lets it write free text, but once it opens a call, only a valid one."""
    tok = served.policy.tokenizer
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "c": 123}}\n</tool_call>'
    strict = {**ADD, "function": {**ADD["function"], "strict": True}}
    with forced_tokens(served, tok.encode(bad)):
        reply = served.client().chat.completions.create(
            model=MODEL, messages=USER, tools=[strict], max_tokens=60, seed=0
        )
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS["add"])
    assert arguments["a"] == 1  # the scripted tokens were followed while they were valid
    # the same script without `strict` is returned as written: nothing is enforced under "auto"
    with forced_tokens(served, tok.encode(bad)):
        free = served.client().chat.completions.create(model=MODEL, messages=USER, tools=[ADD], max_tokens=60)
    assert json.loads(free.choices[0].message.tool_calls[0].function.arguments) == {"a": 1, "c": 123}


def test_the_responses_api_text_format_is_enforced(served):
    schema = Weather.model_json_schema() | {"additionalProperties": False}
    response = served.client().responses.create(
        model=MODEL,
        input="Weather?",
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}},
        max_output_tokens=60,
        extra_body={"seed": 5},
    )
    assert response.status == "completed" and response.text.format.type == "json_schema"
    Weather.model_validate_json(response.output_text)


@pytest.mark.parametrize(
    "request_fields, param, says",
    [
        ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})}, "response_format", "uniq"),
        ({"response_format": json_schema_format({"type": "string"}), "stop": ["}"]}, "stop", "cut"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"not": {}}}}]},
            "tools.0.function.parameters",
            '"not"',
        ),
        ({"logit_bias": {"11": 5}}, "logit_bias", "sampling distribution"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "only 0"),
        ({"functions": [{"name": "f"}]}, "functions", "use 'tools'"),
        ({"web_search_options": {}}, "web_search_options", "web search"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(served, request_fields, param, says):
    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **request_fields)
    assert err.value.body["param"].startswith(param) and says in err.value.body["message"], err.value.body


def test_a_responses_schema_that_cannot_be_enforced_is_named_in_responses_terms(served):
    with pytest.raises(openai.BadRequestError) as err:
        served.client().responses.create(
            model=MODEL,
            input="hi",
            text={"format": {"type": "json_schema", "name": "x", "schema": {"if": {}, "then": {}}}},
        )
    assert err.value.body["param"] == "text.format.schema" and '"if"' in err.value.body["message"]


# ----------------------------------------------------------------------------- any schema, every reply

LEAVES = st.one_of(
    st.tuples(st.integers(-20, 20), st.integers(0, 30)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(
        st.sampled_from(["red", "green", "a b", 'q"t', "é", 7, None, True]), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values}),
)
KEYS = st.text(alphabet="abcxyz_", min_size=1, max_size=4)


def _object(properties: dict, required: list) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


SCHEMA_TREES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.dictionaries(KEYS, inner, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: _object(props, sorted(req))
            )
        ),
        st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
        ),
        st.lists(inner, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=5,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMA_TREES, seed=st.integers(0, 2**31))
def test_every_reply_that_ends_validates_against_its_schema(served, schema, seed):
    reply = served.client().chat.completions.create(
        model=MODEL, messages=USER, response_format=json_schema_format(schema), max_tokens=96, seed=seed, n=3
    )
    for choice in reply.choices:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)


# ----------------------------------------------------------------------------- exact for RL


def test_the_trainer_masks_its_log_probs_as_the_sampler_did(served):
    """A structured call and a free one, recorded; their samples' log-probs recomputed by the
    trainer (grammar replayed) equal the recorded ones, forced positions carry no loss, and the
    update's logprob_diff_abs is as small as the free call's."""
    policy = served.policy
    client = served.client
    spans = {}
    for kind, fields in (
        ("structured", {"response_format": json_schema_format(Weather.model_json_schema())}),
        ("free", {}),
    ):
        rid, aid = served.new_attempt()
        client(served.server.rollout_base_url(rid, aid)).chat.completions.create(
            model=MODEL, messages=USER, max_tokens=40, temperature=0.7, seed=11, n=2, **fields
        )
        spans[kind] = served.spans(rid, aid)
    for span in spans["structured"]:
        constraint = span.attributes["constraint"]
        assert constraint["kind"] == "json_schema" and len(constraint["allowed"]) == len(span.response_token_ids)
        forced = [i for i, n in enumerate(constraint["allowed"]) if n == 1]
        assert forced and all(span.response_logprobs[i] == 0.0 for i in forced)  # p = 1 under the mask
    assert all("constraint" not in span.attributes for span in spans["free"])

    diffs = {}
    for kind, kind_spans in spans.items():
        samples = [
            s for span in kind_spans for s in spans_to_samples([span], reward=float(len(span.response_token_ids)))
        ]
        for sample, span in zip(samples, kind_spans):
            assert sample.mask == [
                int(n != 1) for n in span.attributes.get("constraint", {}).get("allowed", [2] * len(sample.mask))
            ]
        batch = TokenBatch.build(samples, 2, False, grammar_masks=grammar_masks(samples, policy))
        assert (batch.grammar_index_BT is not None) == (kind == "structured")
        with torch.no_grad():
            logp_BT, _ = completion_logprobs(policy, batch)
        real_BT = batch.completion_attention_BT.bool()
        torch.testing.assert_close(logp_BT[real_BT], batch.old_logp_BT[real_BT], atol=2e-4, rtol=1e-4)
        if kind == "structured":  # the masked distribution, not the model's own: far apart where the mask bites
            with torch.no_grad():
                unmasked_BT, _ = completion_logprobs(policy, TokenBatch.build(samples, 2, False))
            assert (unmasked_BT[real_BT] - logp_BT[real_BT]).abs().max() > 1.0
        assert served.idle()
        update = GRPOUpdate(policy, GRPOConfig(lr=0.0, weight_decay=0.0, loss={"type": "grpo"}))
        metrics = update.step(samples, [1.0, -1.0])
        assert metrics["constrained_tokens"] == (
            sum(map(sum, (s.mask for s in samples))) if kind == "structured" else 0
        )
        diffs[kind] = metrics["logprob_diff_abs"]
    assert diffs["structured"] <= max(1.5 * diffs["free"], 1e-5), diffs


def test_replay_rebuilds_the_masks_and_refuses_tokens_off_the_grammar(served):
    tokenizer = policy_grammar_tokenizer(served.policy)
    grammar = Grammar.json_schema({"type": "object", "properties": {"a": DIGIT}, "required": ["a"]})
    tokens = served.policy.tokenizer.encode('{"a": 4}') + [2]
    bitmask = replay(grammar.text, tokens, tokenizer)
    state, fresh = GrammarState(grammar, tokenizer), torch.empty_like(bitmask[0])
    for t, token in enumerate(tokens):
        state.fill(fresh)
        assert torch.equal(fresh, bitmask[t]) and (bitmask[t, token // 32] >> (token % 32)) & 1
        state.consume(token)
    with pytest.raises(ValueError, match="does not follow"):
        replay(grammar.text, served.policy.tokenizer.encode('{"b": 4}'), tokenizer)


def test_a_free_sequence_samples_the_same_beside_a_constrained_one(served):
    """Rows without a grammar pay nothing and see nothing of their neighbours' masks: with every row
    its own batch (batch_invariant), a seeded free sequence samples the same ids and log-probs alone
    and next to one under a grammar."""
    from agl.policy.engine import Engine, SamplingParams

    prompt = served.policy.render_chat(USER)
    free = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    constrained = SamplingParams(max_tokens=12, temperature=0.8, seed=4, grammar=Grammar.json_schema(DIGIT))

    async def run(*params):
        engine = Engine(served.policy, batch_invariant=True)
        await engine.start()
        try:
            streams = [engine.submit(prompt, p)[0] for p in params]
            return [await s.wait() for s in streams]
        finally:
            await engine.stop()

    [alone] = served.call(run(free))
    beside, digit = served.call(run(free, constrained))
    assert beside.token_ids == alone.token_ids and beside.logprobs == alone.logprobs and not beside.allowed
    assert digit.finish_reason == "stop" and 0 <= int(served.policy.tokenizer.decode(digit.token_ids[:-1])) <= 9
    assert len(digit.allowed) == len(digit.token_ids) and digit.allowed[-1] == 1 and digit.logprobs[-1] == 0.0
