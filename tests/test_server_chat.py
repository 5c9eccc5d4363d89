"""Unit tests of the route's pure parts: request schemas, output assembly (stop strings,
streaming, UTF-8), tool-call parsing and prompt rendering with exact prefix reuse."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.policy.load import Policy
from agl.policy.weights import resolve_model_path
from agl.route import tool_prompt as tool_prompt
from agl.route.output import OutputAssembler
from agl.route.rendering import History, Turn, decode, render_prompt, template_messages
from agl.route.requests import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from agl.route.tool_calls import ToolCallParser, parse_tool_calls

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model_cfg):
    from transformers import AutoTokenizer

    path = resolve_model_path("tiny", tiny_model_cfg.cache_dir, dict(tiny_model_cfg.tiny))
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def policy(tokenizer):
    """Only the tokenizer matters for rendering; no weights are needed."""
    return Policy(
        model=None,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
        eos_token_ids=[EOS],
        context_length=2048,
        name="tok",
    )


# ----------------------------------------------------------------------------- schemas


def parse(model, body):
    return parse_request(model, json.dumps(body).encode())


def test_chat_request_accepts_openai_shapes_and_ignores_unknown_fields():
    req = parse(
        ChatCompletionRequest,
        {
            "model": "x",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                    ],
                },
                {"role": "tool", "content": "3", "tool_call_id": "c1"},
            ],
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "stop": "END",
            "logprobs": True,
            "top_logprobs": 3,
            "parallel_tool_calls": True,  # unknown: ignored
            "frequency_penalty": 0,
        },
    )
    assert req.token_limit == 5 and req.stop_strings == ["END"] and req.n_top_logprobs == 3
    assert [m["content"] for m in template_messages(req.messages)] == ["S", "ab", "", "3"]
    assert template_messages(req.messages)[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "3"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_chat_request_rejections_name_the_param(body, param):
    with pytest.raises(APIError) as err:
        parse(ChatCompletionRequest, body)
    assert err.value.status == 400 and err.value.type == "invalid_request_error"
    if param:
        assert err.value.param.startswith(param)


def test_developer_messages_are_system_messages_and_images_are_named():
    req = parse(
        ChatCompletionRequest,
        {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}]},
    )
    assert [m["role"] for m in template_messages(req.messages)] == ["system", "user"]
    for part in (
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_image", "image_url": "x"},
    ):
        with pytest.raises(APIError, match="Images are not supported"):
            parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [part]}]})
    named = {"type": "function", "function": {"name": "add"}}
    req = parse(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [ADD], "tool_choice": named}
    )
    assert req.tool_choice_json == named
    with pytest.raises(APIError, match="'sub' is not in 'tools'"):
        parse(
            ChatCompletionRequest,
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [ADD],
                "tool_choice": {**named, "function": {"name": "sub"}},
            },
        )


def test_invalid_json_and_non_object_bodies_are_400():
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b'{"prompt": "a\\ud800"}'):
        with pytest.raises(APIError) as err:
            parse_request(ChatCompletionRequest, raw)
        assert err.value.status == 400


def test_escaped_surrogate_pairs_are_fine_but_lone_halves_are_not():
    assert parse_request(CompletionRequest, b'{"prompt": "\\ud83d\\ude00"}').prompt == "\U0001f600"
    with pytest.raises(APIError, match="surrogate"):
        parse_request(CompletionRequest, b'{"prompt": "x", "stop": "\\udc00"}')


def test_completion_prompt_forms():
    assert parse(CompletionRequest, {"prompt": "hi"}).prompt == "hi"
    assert parse(CompletionRequest, {"prompt": [5, 6]}).prompt == [5, 6]
    assert parse(CompletionRequest, {"prompt": ["hi"]}).prompt == "hi"
    assert parse(CompletionRequest, {"prompt": [[7]], "logprobs": 0}).wants_logprobs
    for bad in ({"prompt": ["a", "b"]}, {"prompt": []}, {"prompt": [-1]}, {"prompt": "x", "echo": True}, {}):
        with pytest.raises(APIError):
            parse(CompletionRequest, bad)


# ----------------------------------------------------------------------------- output assembly


def assemble(tokenizer, ids, stops=(), stream=False):
    """Feed ``ids`` as the route does; returns the assembler and the text of all deltas."""
    out = OutputAssembler(tokenizer, stops, {EOS})
    deltas = []
    for t in ids:
        out.add(t, -1.0)
        if out.stop_matched:
            break
        if stream:
            deltas.append(out.release())
    out.finish()
    deltas.append(out.release(final=True))
    assert [t for d in deltas for t in d.token_ids] == out.token_ids  # every token is in exactly one delta
    assert all(d.text or d is deltas[-1] for d in deltas if d.token_ids)  # tokens travel with their text
    return out, "".join(d.text for d in deltas)


def test_eos_ends_text_without_its_own_text(tokenizer):
    ids = tokenizer.encode(" hello world") + [EOS]
    out, text = assemble(tokenizer, ids)
    assert text == out.text == " hello world" and out.ended_on_stop_token and out.token_ids == ids


def test_stop_string_across_tokens_truncates_and_records_up_to_the_match(tokenizer):
    ids = tokenizer.encode(" alpha beta gamma delta")
    out, text = assemble(tokenizer, ids, stops=["ta gam"], stream=True)
    assert text == out.text == " alpha be"
    assert out.stop_matched == "ta gam"
    assert decode(tokenizer, out.token_ids).startswith(" alpha beta gam")  # ends at the completing token
    assert len(out.token_ids) < len(ids)


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer.encode("é漢字🙂 ok")
    out, text = assemble(tokenizer, ids, stream=True)
    assert text == "é漢字🙂 ok" and "\ufffd" not in text


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.sampled_from(["a", " b", "cd", " stop", "STOP", "é", "\n", " x y"]), min_size=0, max_size=12),
    stops=st.lists(st.sampled_from(["STOP", " x", "cd\n", "é a"]), max_size=2),
)
def test_streamed_text_equals_final_text_and_excludes_stop_strings(tokenizer, words, stops):
    ids = tokenizer.encode("".join(words))
    streamed_out, streamed = assemble(tokenizer, ids, stops, stream=True)
    whole_out, whole = assemble(tokenizer, ids, stops, stream=False)
    assert streamed == whole == streamed_out.text
    assert not any(s in whole for s in stops)
    full = decode(tokenizer, ids)
    first = min([full.find(s) for s in stops if s in full], default=len(full))
    assert whole == full[:first]


# ----------------------------------------------------------------------------- tool calls


def test_parse_tool_calls():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("neg", {"x": 3}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse_tool_calls("plain") == ("plain", [])
    bad = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')[0] is None
    # arguments are the model's own text; a call cut short (max_tokens) is still a call, as OpenAI's are
    assert (
        parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a":1} }</tool_call>')[1][0]["function"]["arguments"]
        == '{"a":1}'
    )
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": [1')[1][0]["function"] == {
        "name": "f",
        "arguments": '{"a": [1',
    }
    cut, whole = ToolCallParser(), ToolCallParser()
    (
        cut.feed('<tool_call>{"name": "f", "arguments": {"a": [1'),
        whole.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call> and on'),
    )
    cut.finish(), whole.finish()
    assert cut.cut_in_call and not whole.cut_in_call  # finish_reason "length" vs "tool_calls"
    assert parse_tool_calls('x <tool_call>{"name": "f"') == ('x <tool_call>{"name": "f"', [])


def assemble_deltas(deltas):
    """What a client makes of streamed deltas: content joined, tool calls merged by index."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None and tc["function"]["arguments"] == ""  # announced once, with empty arguments
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            call["arguments"] += tc["function"].get("arguments", "")
    return content or None, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


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
        '{"name": "f"}',
        "{",
        '{"a": 1}',
        "}",
        '"{\\"x\\": 2}"',
        '{"arguments": {}, "name": "g"}',
        "oops",
        '"name"',
        ": ",
        "\\",
    ]
)


@settings(max_examples=300, deadline=None)
@given(text=st.lists(pieces, max_size=12).map("".join), data=st.data())
def test_streamed_tool_deltas_add_up_to_the_whole_parse_however_the_text_is_cut(text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parser, deltas, last = ToolCallParser(), [], 0
    for cut in cuts + [len(text)]:
        deltas += parser.feed(text[last:cut])
        last = cut
    deltas += parser.finish()
    content, calls = parse_tool_calls(text)
    assert assemble_deltas(deltas) == (
        content,
        [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in parser.calls],
    )
    assert (parser.content, [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]) == (
        content,
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
    )


def test_content_streams_before_the_call_and_arguments_stream_in_fragments():
    parser = ToolCallParser()
    assert parser.feed("Adding. <tool") == [{"content": "Adding."}]  # the tag's start is held back
    announced, fragment = parser.feed('_call>\n{"name": "add", "arguments": {"a"')
    assert announced["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert fragment == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert parser.feed(": 1}") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1"}}]}
    ]  # "}" may close the call
    assert parser.feed("}\n</tool_call>") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert parser.finish() == [] and parser.calls[0]["function"]["arguments"] == '{"a": 1}'


# ----------------------------------------------------------------------------- the built-in tool prompt

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
    },
}


def test_builtin_tool_prompt_renders_inside_the_models_own_template(policy, tokenizer):
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "4"},
    ]
    assert tool_prompt.needs_builtin(policy.supports_tools, messages, [ADD]) and not tool_prompt.needs_builtin(
        True, messages, [ADD]
    )
    text = decode(tokenizer, render_prompt(policy, tool_prompt.builtin_messages(messages, [ADD]), None).ids)
    assert text == (
        "<|im_start|>system\nBe exact.\n\n" + tool_prompt.tools_section([ADD]) + "<|im_end|>\n"
        "<|im_start|>user\n1+2?<|im_end|>\n"
        '<|im_start|>assistant\nLet me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert json.dumps(ADD) in tool_prompt.tools_section([ADD])
    # no system message: the tools make one; no tools (tool_choice "none"): no tools section
    assert tool_prompt.builtin_messages(messages[1:2], [ADD])[0] == {
        "role": "system",
        "content": tool_prompt.tools_section([ADD]),
    }
    assert tool_prompt.builtin_messages(messages[:2], None) == messages[:2]


def test_an_earlier_reply_is_rendered_as_the_model_wrote_it(policy):
    reply = '  <tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'  # how the model wrote it
    call = [{"id": "c9", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    said = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "", "tool_calls": call}]
    assert tool_prompt.builtin_messages(said, None, [reply, "other"])[1]["content"] == reply
    canonical = tool_prompt.builtin_messages(said, None)[1]["content"]
    assert canonical == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    other_args = [{**call[0], "function": {"name": "add", "arguments": {"a": 1, "b": 3}}}]  # the agent changed the call
    assert (
        tool_prompt.builtin_messages([said[0], {**said[1], "tool_calls": other_args}], None, [reply])[1]["content"]
        != reply
    )


# ----------------------------------------------------------------------------- prefix reuse


def test_reply_that_retokenizes_differently_keeps_its_sampled_ids(policy, tokenizer):
    first = [{"role": "user", "content": "Say hello"}]
    prompt1 = render_prompt(policy, first, None).ids
    sampled = [tokenizer.encode(" ")[0], tokenizer.encode("hello")[0], EOS]  # " " + "hello", not " hello"
    assert tokenizer.encode(" hello") != sampled[:2]
    turn = Turn(prompt1, sampled, decode(tokenizer, prompt1))
    second = first + [{"role": "assistant", "content": " hello"}, {"role": "user", "content": "Again"}]

    prompt2 = render_prompt(policy, second, None, [turn])
    assert prompt2.ids[: len(prompt1) + 3] == prompt1 + sampled and prompt2.reused == len(prompt1) + 3
    assert decode(tokenizer, prompt2.ids) == decode(tokenizer, policy.render_chat(second))
    assert prompt2.ids != policy.render_chat(second)  # from scratch would re-tokenize " hello"


def test_reply_cut_by_a_length_limit_or_stop_string_reuses_what_lines_up(policy, tokenizer):
    first = [{"role": "user", "content": "Count"}]
    prompt1 = policy.render_chat(first)
    response = tokenizer.encode(" one two three")  # no eos: length-limited
    turn = Turn(prompt1, response, decode(tokenizer, prompt1))
    # the template closes the turn itself: all sampled ids are reused
    full = render_prompt(
        policy,
        first + [{"role": "assistant", "content": " one two three"}, {"role": "user", "content": "More"}],
        None,
        [turn],
    )
    assert full.reused == len(prompt1) + len(response)
    # a stop string cut the text: only the ids inside the returned text are reused
    cut = render_prompt(
        policy, first + [{"role": "assistant", "content": " one tw"}, {"role": "user", "content": "More"}], None, [turn]
    )
    assert cut.ids[: cut.reused] == prompt1 + tokenizer.encode(" one")
    # an unrelated conversation renders from scratch
    other = [{"role": "user", "content": "Different"}]
    assert render_prompt(policy, other, None, [turn]).ids == policy.render_chat(other)


def test_the_longest_matching_turn_wins_and_history_is_bounded(policy, tokenizer):
    history = History(max_attempts=2, turns_per_attempt=2)
    msgs = [{"role": "user", "content": "Q"}]
    p1 = policy.render_chat(msgs)
    r1 = tokenizer.encode("A") + [EOS]
    msgs2 = msgs + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]
    p2 = render_prompt(policy, msgs2, None, [Turn(p1, r1, decode(tokenizer, p1))]).ids
    r2 = tokenizer.encode("B") + [EOS]
    for turn in (Turn(p1, r1, decode(tokenizer, p1)), Turn(p2, r2, decode(tokenizer, p2))):
        history.add("k", turn)
    msgs3 = msgs2 + [{"role": "assistant", "content": "B"}, {"role": "user", "content": "Q3"}]
    assert render_prompt(policy, msgs3, None, history.get("k")).reused == len(p2) + len(r2)
    history.add("k", Turn([1], [2], "x"))
    assert len(history.get("k")) == 2
    history.add("a", Turn([1], [2], "x"))
    history.add("b", Turn([1], [2], "x"))
    assert "k" not in history and history.get("k") is None


@pytest.mark.parametrize("junk", [[], {}, 3, None])
def test_a_content_part_with_a_junk_type_is_a_400(junk):
    """Found by the route fuzz test: a part whose type was a list made the text-part check raise TypeError (a 500)."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": junk, "text": ""}]}]}
    with pytest.raises(APIError) as err:
        parse_request(ChatCompletionRequest, json.dumps(body).encode())
    assert err.value.status == 400
