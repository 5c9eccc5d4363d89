"""The Responses API (``POST /v1/responses``): its translation to the chat pipeline, its output
items and stream events (pure), and the real route with the real ``openai`` client (and the
OpenAI Agents SDK's default model, when installed) on the tiny policy."""

import asyncio
import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import EOS, MODEL, TIMEOUT, forced_tokens, reply_ids, served  # noqa: F401  (served: the route fixture)

from agl.route import responses_api as responses
from agl.route.recording import ResponseStore, StoredResponse
from agl.route.rendering import decode
from agl.route.requests import APIError, parse_request
from agl.route.response_models import OutputBuilder
from agl.route.responses_api import ResponsesRequest, parse_items, to_chat_request
from agl.route.tool_calls import ToolCallParser
from agl.train.samples import spans_to_samples

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    "strict": False,
}
CALL = (
    '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'  # compact: re-rendered JSON would have spaces
)


def request(body):
    req = parse_request(ResponsesRequest, json.dumps(body).encode())
    return req, parse_items(req.input)


def chat(body):
    req, items = request(body)
    return to_chat_request(req, items)


# ----------------------------------------------------------------------------- translation


def test_input_items_become_the_chat_conversation():
    call = {
        "type": "function_call",
        "call_id": "c1",
        "name": "add",
        "arguments": '{"a": 1}',
        "id": "fc_1",
        "status": "completed",
    }
    req = chat(
        {
            "model": "x",
            "instructions": "Be exact.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "1+"}, {"type": "input_text", "text": "2?"}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "m1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Adding.", "annotations": [], "logprobs": None}],
                },
                call,
                {**call, "call_id": "c2", "arguments": {"a": 2}},
                {"type": "function_call_output", "call_id": "c1", "output": "3"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "4"}]},
                {"role": "user", "content": "And?"},
            ],
            "tools": [ADD],
            "tool_choice": {"type": "function", "name": "add"},
            "max_output_tokens": 7,
            "temperature": 0.5,
            "parallel_tool_calls": False,  # accepted; recorded as sent
            "truncation": "auto",
            "reasoning": {"effort": "low"},
            "user": "u",
            "prompt_cache_key": "k",
            "text": {"format": {"type": "text"}},
            "include": ["reasoning.encrypted_content"],
        }
    )
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    assert messages == [
        {"role": "system", "content": "Be exact."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "1+2?"},
        {  # one model reply: its text and both calls in one assistant message
            "role": "assistant",
            "content": "Adding.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}},
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        {"role": "tool", "content": "4", "tool_call_id": "c2"},
        {"role": "user", "content": "And?"},
    ]
    assert req.token_limit == 7 and req.temperature == 0.5 and req.top_p == 1.0 and not req.logprobs
    assert [t.model_dump(exclude_none=True) for t in req.tools] == [
        {"type": "function", "function": {k: ADD[k] for k in ("name", "description", "parameters")}}
    ]
    assert req.tool_choice_json == {"type": "function", "function": {"name": "add"}}

    plain = chat({"input": "Hi"})
    assert [m.model_dump(exclude_none=True) for m in plain.messages] == [
        {"role": "user", "content": "Hi"}
    ] and plain.temperature == 1.0
    assert chat({"input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 3}).n_top_logprobs == 3
    assert chat({"input": "Hi", "top_logprobs": 3}).n_top_logprobs == 0  # logprobs only when included, as OpenAI
    only_call = chat({"input": [call, {"type": "function_call_output", "call_id": "c1", "output": "3"}]})
    assert only_call.messages[0].content is None and only_call.messages[0].tool_calls[0].id == "c1"
    # allowed_tools narrows the tools and sets the mode
    narrowed = chat(
        {
            "input": "x",
            "tools": [ADD, {**ADD, "name": "sub"}],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "sub"}],
            },
        }
    )
    assert [t.function.name for t in narrowed.tools] == ["sub"] and narrowed.tool_choice == "required"


@pytest.mark.parametrize(
    "body,param,says",
    [
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
                ]
            },
            "input.0.content",
            "Images are not supported",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content",
            "Files are not supported",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_image", "image_url": "x"}],
                    }
                ]
            },
            "input.0.output",
            "Images",
        ),
        ({"input": ["hi"]}, "input.0", "must be an object"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "previous_response_id"),
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0.type", "not supported"),
        ({"input": [{"content": "no role"}]}, "input.0.type", "not supported"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role", None),
        ({"input": [{"role": "user"}]}, "input.0.content", None),
        ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input.0.call_id", None),
        (
            {
                "input": [
                    {"role": "user", "content": "x"},
                    {"type": "function_call_output", "call_id": "nope", "output": "3"},
                ]
            },
            "input.1.call_id",
            "no function_call",
        ),
        ({"input": []}, "input", "nothing to respond to"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only tools of type 'function'"),
        (
            {"input": "x", "tools": [{"type": "function", "function": {"name": "add"}}]},
            "tools.0.name",
            None,
        ),  # the chat shape
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        (
            {"input": "x", "tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}},
            "tool_choice",
            "'sub' is not in 'tools'",
        ),
        (
            {
                "input": "x",
                "tools": [ADD],
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "function", "name": "sub"}],
                },
            },
            "tool_choice",
            "'sub'",
        ),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "function tools only"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
        ({"input": "x", "temperature": 3}, "temperature", None),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ],
)
def test_bad_requests_name_the_param(body, param, says):
    with pytest.raises(APIError) as err:
        chat(body)
    assert err.value.status == 400 and err.value.type == "invalid_request_error"
    assert err.value.param == param, err.value.message
    if says:
        assert says in err.value.message


# ----------------------------------------------------------------------------- output items


def reassemble(events):
    """Rebuild the output from stream events the way a client does (and check their order)."""
    items, open_items = {}, set()
    for e in events:
        kind, index = e["type"], e.get("output_index")
        if kind == "response.output_item.added":
            assert index == len(items) and not open_items  # one item at a time, in order
            items[index] = json.loads(json.dumps(e["item"]))
            open_items.add(index)
        elif kind == "response.content_part.added":
            items[index]["content"].append(dict(e["part"]))
        elif kind == "response.output_text.delta":
            items[index]["content"][e["content_index"]]["text"] += e["delta"]
        elif kind == "response.output_text.done":
            assert items[index]["content"][e["content_index"]]["text"] == e["text"]
        elif kind == "response.function_call_arguments.delta":
            items[index]["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert items[index]["arguments"] == e["arguments"]
        elif kind == "response.output_item.done":
            open_items.remove(index)
            assert {k: v for k, v in items[index].items() if k not in ("status", "content")} == {
                k: v for k, v in e["item"].items() if k not in ("status", "content")
            }
            items[index] = e["item"]
    assert not open_items
    return [items[i] for i in sorted(items)]


def build(text, cuts=(), tools=True, incomplete=False):
    parser, builder, events, last = ToolCallParser(), OutputBuilder(), [], 0
    for cut in list(cuts) + [len(text)]:
        piece = text[last:cut]
        events += builder.feed(parser.feed(piece) if tools else ([{"content": piece}] if piece else []))
        last = cut
    events += builder.feed(parser.finish() if tools else []) + builder.finish(incomplete)
    return builder.items, events


def shape(items):
    """Items without their random ids."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_text_and_calls_become_message_and_function_call_items():
    items, events = build('Adding.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', cuts=[3, 20, 40])
    assert shape(items) == [
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Adding.", "annotations": [], "logprobs": []}],
        },
        {"type": "function_call", "status": "completed", "name": "add", "arguments": '{"a": 1}'},
    ]
    assert (
        items[1]["id"].startswith("fc_")
        and items[1]["call_id"].startswith("call_")
        and items[0]["id"].startswith("msg_")
    )
    assert reassemble(events) == items
    assert [e["type"] for e in events][:2] == ["response.output_item.added", "response.content_part.added"]
    # nothing written: one empty message; cut by the limit: the last item is incomplete
    assert shape(build("")[0]) == [
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
        }
    ]
    cut, _ = build('<tool_call>\n{"name": "add", "arguments": {"a"', incomplete=True)
    assert shape(cut) == [{"type": "function_call", "status": "incomplete", "name": "add", "arguments": '{"a"'}]
    # without tools the text is returned as written, tool tags and whitespace included
    raw = " <tool_call>x</tool_call> "
    assert build(raw, tools=False)[0][0]["content"][0]["text"] == raw


pieces = st.sampled_from(
    [
        "Sure. ",
        " ",
        "\n",
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "call>",
        '{"name": "add", "arguments": ',
        '{"a": 1}',
        "}",
        "oops",
        '{"name": "f"}',
    ]
)


@settings(max_examples=150, deadline=None)
@given(text=st.lists(pieces, max_size=10).map("".join), data=st.data())
def test_items_are_the_same_however_the_reply_is_cut_and_events_rebuild_them(text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    items, events = build(text, cuts)
    whole, _ = build(text)
    assert shape(items) == shape(whole) and reassemble(events) == items
    # passed back as input, the items are the one assistant message the chat route returns
    content = ToolCallParser()
    content.feed(text), content.finish()
    [message] = responses.chat_messages(None, responses.output_items(items))
    assert (message.get("content") or None) == content.content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in content.calls
    ]


def test_stored_responses_are_bounded_and_kept_per_route():
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put(f"r{i}", StoredResponse(("ro", "at"), [], [], {"id": f"r{i}"}))
    assert store.get("r0", ("ro", "at")) is None and len(store) == 2
    assert (
        store.get("r1", ("ro", "at")) is not None
        and store.get("r1", None) is None
        and store.get("r1", ("ro", "other")) is None
    )
    store.put("r3", StoredResponse(None, [], [], {}))
    assert store.get("r2", ("ro", "at")) is None  # r1 was used more recently
    assert store.delete("r3", None) and not store.delete("r3", None)


# ----------------------------------------------------------------------------- the route


def test_text_response_is_recorded_as_a_chat_span(served):
    tok = served.policy.tokenizer
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    with forced_tokens(served, tok.encode(" hello there")):
        r = client.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input="What is 2 + 2?",
            max_output_tokens=10,
            temperature=0.7,
            metadata={"run": "t1"},
            include=["message.output_text.logprobs"],
            top_logprobs=2,
            store=True,
        )
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_") and r.model == MODEL
    assert (
        r.output_text == " hello there"
        and r.metadata == {"run": "t1"}
        and r.temperature == 0.7
        and r.max_output_tokens == 10
    )
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"

    [span] = served.spans(rid, aid)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert span.name == "llm.chat" and span.prompt_token_ids == served.policy.render_chat(conversation)
    assert decode(tok, reply_ids(span)) == r.output_text and span.response_token_ids[-1] == EOS
    assert r.usage.input_tokens == len(span.prompt_token_ids) and r.usage.output_tokens == len(span.response_token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    attrs = span.attributes
    assert attrs["request"]["messages"] == conversation and attrs["request"]["sampling"]["temperature"] == 0.7
    assert attrs["request"]["sampling"]["seed_from"] == "derived" and isinstance(
        attrs["request"]["sampling"]["seed"], int
    )
    assert attrs["request"]["responses"] == {
        "api": "responses",
        "id": r.id,
        "previous_response_id": None,
        "metadata": {"run": "t1"},
        "store": True,
    }
    assert attrs["chat_template"] == "model" and attrs["finish_reason"] == "stop" and attrs["forced_tokens"] == 0
    # logprobs: one per token of the text (the eos wrote none), as recorded
    logprobs = message.content[0].logprobs
    assert [lp.logprob for lp in logprobs] == pytest.approx(span.response_logprobs[:-1], abs=1e-5)
    assert "".join(lp.token for lp in logprobs) == r.output_text and all(len(lp.top_logprobs) == 2 for lp in logprobs)

    assert client.responses.retrieve(r.id).output_text == r.output_text  # stored
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        served.client().responses.retrieve(r.id)  # another route's responses are not found


def test_streamed_text_matches_the_recorded_span(served):
    tok = served.policy.tokenizer
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    with forced_tokens(served, tok.encode(" alpha beta")):
        events = list(
            client.responses.create(
                model=MODEL,
                input="Say it.",
                max_output_tokens=10,
                stream=True,
                include=["message.output_text.logprobs"],
            )
        )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == final.output_text == " alpha beta"
    assert all(e.item_id == final.output[0].id and e.output_index == 0 for e in deltas)
    [span] = served.spans(rid, aid)
    assert decode(tok, reply_ids(span)) == final.output_text and final.usage.output_tokens == len(
        span.response_token_ids
    )
    assert [lp.logprob for e in deltas for lp in e.logprobs] == pytest.approx(span.response_logprobs[:-1], abs=1e-5)

    # the SDK's stream helper assembles the same response; a cut reply is "incomplete", as OpenAI's
    with forced_tokens(served, tok.encode(" alpha beta")):
        with client.responses.stream(model=MODEL, input="Say it.", max_output_tokens=10) as stream:
            assert stream.get_final_response().output_text == " alpha beta"
    with forced_tokens(served, tok.encode(" one two three four")):
        cut = list(client.responses.create(model=MODEL, input="Count.", max_output_tokens=2, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.output[0].status == "incomplete"
    with forced_tokens(served, tok.encode(" one two three four")):
        whole = client.responses.create(model=MODEL, input="Count.", max_output_tokens=2)
    assert whole.status == "incomplete" and whole.output_text == cut[-1].response.output_text
    assert served.spans(rid, aid)[-1].attributes["finish_reason"] == "length"


def test_tool_call_then_its_output_merge_into_one_sample(served):
    """tool_choice "required" forces the call's start; the follow-up (items passed back, or
    previous_response_id) starts with the first call's exact prompt + sampled tokens."""
    tok = served.policy.tokenizer
    sampled = 'add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    prompts = []
    for how in ("items", "previous_response_id"):
        rid, aid = served.new_attempt()
        client = served.client(served.server.rollout_base_url(rid, aid))
        with forced_tokens(served, tok.encode(sampled)):
            r = client.responses.create(
                model=MODEL,
                instructions="Use the tools.",
                input="What is 1 + 2?",
                tools=[ADD],
                tool_choice="required",
                max_output_tokens=40,
            )
        [call] = r.output
        assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
        assert call.call_id.startswith("call_") and call.status == "completed" and r.output_text == ""
        assert r.tool_choice == "required" and r.tools[0].name == "add"

        result = {"type": "function_call_output", "call_id": call.call_id, "output": "3"}
        with forced_tokens(served, tok.encode("It is 3.")):
            if how == "items":
                passed_back = (
                    [{"role": "user", "content": "What is 1 + 2?"}]
                    + [item.model_dump(exclude_none=True) for item in r.output]
                    + [result]
                )
                final = client.responses.create(
                    model=MODEL, instructions="Use the tools.", input=passed_back, tools=[ADD], max_output_tokens=20
                )
            else:
                final = client.responses.create(
                    model=MODEL,
                    instructions="Use the tools.",
                    previous_response_id=r.id,
                    input=[result],
                    tools=[ADD],
                    max_output_tokens=20,
                )
                assert final.previous_response_id == r.id
        assert final.output_text == "It is 3." and final.status == "completed"

        first, second = served.spans(rid, aid)
        forced = first.attributes["forced_tokens"]
        assert (
            forced > 0
            and first.attributes["chat_template"] == "agl-hermes-tools"
            and first.attributes["finish_reason"] == "tool_calls"
        )
        assert decode(tok, reply_ids(first)) == sampled  # the forced start is prompt, not sampled
        exact = first.prompt_token_ids + first.response_token_ids
        assert second.prompt_token_ids[: len(exact)] == exact and second.attributes["prompt_reused_tokens"] == len(
            exact
        )
        assert "<tool_response>\n3\n</tool_response>" in decode(tok, second.prompt_token_ids[len(exact) :])
        [sample] = spans_to_samples([first, second], reward=1.0)
        assert sample.prompt_ids == first.prompt_token_ids
        assert sample.num_sampled == len(first.response_token_ids) + len(second.response_token_ids)
        assert second.attributes["request"]["responses"]["previous_response_id"] == (
            r.id if how == "previous_response_id" else None
        )
        prompts.append(second.prompt_token_ids)
    assert decode(tok, prompts[0]) == decode(tok, prompts[1])  # either way, the same conversation


def test_streamed_tool_call_events(served):
    tok = served.policy.tokenizer
    said = 'Adding.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    with forced_tokens(served, tok.encode(said)):
        events = list(
            client.responses.create(model=MODEL, input="1 + 2?", tools=[ADD], max_output_tokens=60, stream=True)
        )
    final = events[-1].response
    assert events[-1].type == "response.completed" and [item.type for item in final.output] == [
        "message",
        "function_call",
    ]
    assert final.output_text == "Adding." and final.output[1].arguments == '{"a": 1, "b": 2}'
    fragments = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 2 and "".join(e.delta for e in fragments) == final.output[1].arguments
    assert all(e.item_id == final.output[1].id and e.output_index == 1 for e in fragments)
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == final.output[1].arguments
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert (
        added[1].type == "function_call"
        and added[1].name == "add"
        and added[1].arguments == ""
        and added[1].call_id == final.output[1].call_id
    )
    assert reassemble([e.model_dump() for e in events]) == [item.model_dump() for item in final.output]
    [span] = served.spans(rid, aid)
    assert (
        span.attributes["tool_calls"][0]["id"] == final.output[1].call_id
        and span.attributes["finish_reason"] == "tool_calls"
    )

    # not streamed: the same items; the SDK's stream helper assembles them too
    with forced_tokens(served, tok.encode(said)):
        whole = client.responses.create(model=MODEL, input="1 + 2?", tools=[ADD], max_output_tokens=60)
    assert shape([i.model_dump() for i in whole.output]) == shape([i.model_dump() for i in final.output])
    with forced_tokens(served, tok.encode(said)):
        with client.responses.stream(model=MODEL, input="1 + 2?", tools=[ADD], max_output_tokens=60) as stream:
            helped = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in helped.output] == [
        ("message", None),
        ("function_call", '{"a": 1, "b": 2}'),
    ]


def test_bad_input_is_answered_the_openai_way(served):
    client = served.client()
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=1)
    assert err.value.body["code"] == "previous_response_not_found" and err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL, input=[{"type": "web_search_call", "id": "ws", "status": "completed"}], max_output_tokens=1
        )
    assert err.value.body["param"] == "input.0.type"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What?"},
                        {"type": "input_image", "image_url": "https://example.com/a.png"},
                    ],
                }
            ],
            max_output_tokens=1,
        )
    assert "Images are not supported" in err.value.message and err.value.body["param"] == "input.0.content"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="gpt-4o", input="x", max_output_tokens=1)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", max_output_tokens=4000)
    assert err.value.body["param"] == "max_output_tokens" and err.value.body["code"] == "context_length_exceeded"

    # a stored response is found from its own route only, and not when store=false
    rid, aid = served.new_attempt()
    scoped = served.client(served.server.rollout_base_url(rid, aid))
    r = scoped.responses.create(model=MODEL, input="x", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="y", previous_response_id=r.id, max_output_tokens=1)
    unstored = scoped.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        scoped.responses.create(model=MODEL, input="y", previous_response_id=unstored.id, max_output_tokens=1)
    assert (
        scoped.responses.create(
            model=MODEL, input="y", previous_response_id=r.id, max_output_tokens=1
        ).previous_response_id
        == r.id
    )
    assert len(served.spans(rid, aid)) == 3  # the rejected calls recorded nothing

    with pytest.raises(openai.NotFoundError):
        served.client(served.server.rollout_base_url("no-such-rollout", aid)).responses.create(
            model=MODEL, input="x", max_output_tokens=1
        )
    served.call(served.store.update_attempt(rid, aid, status="succeeded"))
    with pytest.raises(openai.ConflictError):
        scoped.responses.create(model=MODEL, input="x", max_output_tokens=1)

    url = served.server.base_url + "/responses"
    for raw in (b"{oops", b"[]", json.dumps({"input": "x", "stream": True, "tools": "nope"}).encode()):
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_disconnected_clients_free_their_slots(served):
    rid, aid = served.new_attempt()
    url = served.server.rollout_base_url(rid, aid) + "/responses"
    long = {"input": "What is 2 + 2?", "max_output_tokens": 1900}
    script = served.policy.tokenizer.encode(" word") * 1900  # no eos: the reply runs to its limit
    with forced_tokens(served, script), httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", url, json={**long, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["type"] == "response.output_text.delta":
                    break  # one token arrived; now hang up
    assert served.idle(), "a streaming client that left still holds its slot"
    with forced_tokens(served, script), httpx.Client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post(url, json=long)
    assert served.idle(), "a client that timed out still holds its slot"
    assert served.spans(rid, aid) == []  # nothing the agent never saw is recorded
    assert not any(
        stored.scope == (rid, aid) for stored in served.server.responses.stored._responses.values()
    )  # or stored


text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=8)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True),
    text,
    st.lists(st.integers(-1, 3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def mostly(valid):
    return st.integers(0, 7).flatmap(lambda k: junk if k == 7 else valid)


part = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(["input_text", "output_text", "input_image", "refusal"])), "text": mostly(text)}
)
item = st.one_of(
    st.fixed_dictionaries(
        {
            "role": mostly(st.sampled_from(["user", "system", "developer", "assistant"])),
            "content": mostly(st.one_of(text, st.lists(part, max_size=2))),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": mostly(st.just("c1")),
            "name": mostly(st.just("add")),
            "arguments": mostly(st.just('{"a": 1}')),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": mostly(st.just("c1")), "output": mostly(text)}
    ),
    st.fixed_dictionaries({"type": mostly(st.sampled_from(["reasoning", "item_reference", "message"]))}),
)
body = st.fixed_dictionaries(
    {"input": mostly(st.one_of(text, st.lists(item, max_size=3))), "max_output_tokens": st.integers(1, 3)},
    optional={
        "instructions": mostly(text),
        "tools": mostly(st.just([ADD])),
        "tool_choice": mostly(st.sampled_from(["none", "auto", "required", {"type": "function", "name": "add"}])),
        "temperature": mostly(st.floats(0, 2)),
        "top_p": mostly(st.floats(0.01, 1)),
        "stream": st.booleans(),
        "store": mostly(st.booleans()),
        "previous_response_id": mostly(st.just("resp_nope")),
        "metadata": mostly(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)),
        "include": mostly(st.just(["message.output_text.logprobs"])),
        "top_logprobs": mostly(st.integers(0, 3)),
        "parallel_tool_calls": junk,
        "reasoning": junk,
        "model": mostly(st.sampled_from([MODEL, "gpt-4o"])),
    },
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=body)
def test_fuzzed_requests_never_get_a_server_error(served, body):
    r = httpx.post(
        served.server.base_url + "/responses",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)
    elif body.get("stream") is True:
        assert '"type": "error"' not in r.text and (
            "event: response.completed" in r.text or "event: response.incomplete" in r.text
        )
    else:
        assert r.json()["status"] in ("completed", "incomplete")


# ----------------------------------------------------------------------------- the OpenAI Agents SDK


def test_an_agents_sdk_agent_with_its_default_responses_model(served):
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    tok = served.policy.tokenizer
    agents.set_tracing_disabled(True)
    added = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        added.append((a, b))
        return a + b

    agent = agents.Agent(
        name="adder",
        instructions="Use the tools.",
        tools=[add],
        model=MODEL,
        model_settings=agents.ModelSettings(max_tokens=60),
    )
    script = [tok.encode('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'), tok.encode("It is 3.")]

    async def run(rid, aid, streamed, **kwargs):
        client = openai.AsyncOpenAI(
            base_url=served.server.rollout_base_url(rid, aid), api_key="unused", max_retries=0, timeout=TIMEOUT
        )
        provider = agents.OpenAIProvider(
            openai_client=client
        )  # what set_default_openai_client sets up; Responses by default
        config = agents.RunConfig(model_provider=provider, tracing_disabled=True)
        assert isinstance(provider.get_model(MODEL), OpenAIResponsesModel)
        try:
            if not streamed:
                return await agents.Runner.run(agent, "What is 1 + 2?", run_config=config, **kwargs)
            result = agents.Runner.run_streamed(agent, "What is 1 + 2?", run_config=config, **kwargs)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    for streamed, kwargs in ((False, {}), (True, {}), (False, {"auto_previous_response_id": True})):
        rid, aid = served.new_attempt()
        with forced_tokens(served, *script):
            result = asyncio.run(run(rid, aid, streamed, **kwargs))
        assert result.final_output == "It is 3." and added[-1] == (1, 2)
        first, second = spans = served.spans(rid, aid)
        assert all(s.name == "llm.chat" and s.attributes["request"]["responses"]["api"] == "responses" for s in spans)
        assert first.attributes["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a":1,"b":2}'}
        exact = first.prompt_token_ids + first.response_token_ids
        assert second.prompt_token_ids[: len(exact)] == exact
        [sample] = spans_to_samples(spans, reward=1.0)
        assert sample.num_sampled == len(first.response_token_ids) + len(second.response_token_ids)
        if kwargs:
            assert (
                second.attributes["request"]["responses"]["previous_response_id"]
                == first.attributes["request"]["responses"]["id"]
            )
