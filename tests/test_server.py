"""The model route over real HTTP with the real `openai` SDK, the real engine and store, and
the tiny policy.

The server runs on its own event loop in a background thread (as it would inside the
harness), so both the blocking `OpenAI` client and `AsyncOpenAI` on the test's loop can talk
to it; `served.call(coro)` runs a coroutine on the server's loop (engine pauses, store reads).
"""

import asyncio
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.policy.engine import Engine
from agl.policy.load import load_policy
from agl.route.rendering import History, decode
from agl.route.server import ModelServer
from agl.store import SqliteStore
from agl.train.samples import spans_to_samples
from agl.types import Span

EOS = 2
TIMEOUT = 60
# Loading the policy may build the model cache first: on a fresh machine the embedded model's conversion, which
# every lane of `make test` waits for at once (agl/policy/weights.py builds an entry once, under a lock).
START_TIMEOUT = 600
MODEL = "tiny"  # the policy's name: the only `model` the route accepts unless told of others


class Served:
    """Engine + store + ModelServer on an event loop of their own, in a daemon thread."""

    def __init__(self, cfg, store_path, device="cpu"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()
        self.call(self._start(cfg, store_path, device), timeout=START_TIMEOUT)

    async def _start(self, cfg, store_path, device):
        self.policy = load_policy(cfg, device)
        self.engine = Engine(self.policy)
        await self.engine.start()
        self.store = SqliteStore(store_path)
        self.server = ModelServer(self.engine, self.policy, self.store)
        await self.server.start()

    def call(self, coro, timeout=TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        async def stop():
            await self.server.stop()
            await self.engine.stop()
            await self.store.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    # helpers
    def new_attempt(self) -> tuple[str, str]:
        attempted = self.call(self.store.start_rollout(input={"task": "test"}))
        return attempted.rollout_id, attempted.attempt.attempt_id

    def spans(self, rollout_id, attempt_id):
        return self.call(self.store.query_spans(rollout_id, attempt_id))

    def client(self, base_url=None, **kwargs):
        return openai.OpenAI(
            base_url=base_url or self.server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT, **kwargs
        )

    def async_client(self, base_url=None):
        return openai.AsyncOpenAI(
            base_url=base_url or self.server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT
        )

    def idle(self, within=2.0) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.engine.num_running == 0 and self.engine.num_waiting == 0:
                return True
            time.sleep(0.02)
        return False


@pytest.fixture(scope="module")
def served(tiny_model_cfg, tmp_path_factory, device):
    served = Served(tiny_model_cfg, tmp_path_factory.mktemp("route") / "store.sqlite", device)
    yield served
    served.close()


def chosen_tokens(span) -> list[int]:
    """The response ids a span's sample trains on: all of them, but those a grammar forced (the only token its
    mask allowed: strict tools, structured replies; agl.route.structure, agl.train.samples)."""
    allowed = (span.attributes.get("constraint") or {}).get("allowed")
    if not allowed:
        return list(span.response_token_ids)
    return [t for t, n in zip(span.response_token_ids, allowed) if n != 1]


@contextlib.contextmanager
def forced_tokens(served, *scripts, then_free: bool = False):
    """Make the model emit ``scripts[0]`` (then eos), one token per forward pass, whatever the
    input; with several scripts, call i writes ``scripts[i]``, then eos. Once the scripts are used
    up the model writes eos again (``then_free``: whatever it likes). Yields the hook's state.

    A forward hook on the output layer replaces the logits; meant for one request in flight,
    so it first waits for the engine to finish steps of earlier (e.g. cancelled) sequences.
    """
    assert served.idle()
    head = served.policy.model.get_output_embeddings()
    state = {"call": 0, "token": 0}

    def hook(module, args, output):
        if then_free and state["call"] >= len(scripts):
            return output
        script = scripts[state["call"]] if state["call"] < len(scripts) else []
        forced = torch.full_like(output, -1e4)
        if state["token"] < len(script):
            forced[..., script[state["token"]]] = 0.0
            state["token"] += 1
        else:
            forced[..., EOS] = 0.0
            state["call"], state["token"] = state["call"] + 1, 0
        return forced

    handle = head.register_forward_hook(hook)
    try:
        yield state
    finally:
        handle.remove()


USER = [{"role": "user", "content": "What is 2 + 2?"}]


def reply_ids(span):
    """Response ids minus a final eos: these decode to the returned text."""
    ids = span.response_token_ids
    return ids[:-1] if ids and ids[-1] == EOS else ids


# ----------------------------------------------------------------------------- basics


def test_models_health_and_api_key(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(served.server.url + "/health").json()
    assert health["status"] == "ok" and health["policy_version"] == served.policy.version

    guarded = ModelServer(served.engine, served.policy, config={"api_key": "sekret"})
    served.call(guarded.start())
    try:
        with pytest.raises(openai.AuthenticationError) as err:
            served.client(guarded.base_url).chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        assert err.value.body["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=guarded.base_url, api_key="sekret", max_retries=0).chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2
        )
        assert ok.usage.completion_tokens == 2
    finally:
        served.call(guarded.stop())


async def test_a_stopped_route_lets_go_of_its_model(tiny_model_cfg, tmp_path):
    """FastAPI keeps the endpoints it has seen (this server's bound methods) in module-level caches: a stopped
    route must not keep its engine and policy alive through them (a sweep's jobs in one process kept every
    earlier job's model)."""
    import gc
    import weakref

    policy = load_policy(tiny_model_cfg, "cpu")
    engine = Engine(policy)
    await engine.start()
    store = SqliteStore(tmp_path / "store.sqlite")
    server = ModelServer(engine, policy, store)
    await server.start()
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        assert (await client.get("/models")).status_code == 200
    await server.stop()
    await engine.stop()
    await store.close()
    gone = weakref.ref(policy), weakref.ref(engine)
    del policy, engine
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
    assert server.engine is None  # the server object itself may live on in FastAPI's caches


def test_chat_round_trip_records_one_exact_span(served):
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=6,
        temperature=0.7,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(r.prompt_token_ids) and r.usage.completion_tokens == len(choice.token_ids)
    assert len(choice.logprobs.content) == len(choice.token_ids) and all(
        len(t.top_logprobs) == 2 for t in choice.logprobs.content
    )

    [span] = served.spans(rid, aid)
    assert span.name == "llm.chat" and span.prompt_token_ids == r.prompt_token_ids == served.policy.render_chat(USER)
    assert span.response_token_ids == choice.token_ids
    assert decode(served.policy.tokenizer, reply_ids(span)) == choice.message.content
    assert span.response_logprobs == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-5)
    attrs = span.attributes
    assert attrs["policy_version"] == served.policy.version and attrs["finish_reason"] == choice.finish_reason
    assert attrs["request"]["messages"] == USER and attrs["request"]["sampling"]["temperature"] == 0.7
    assert attrs["usage"] == {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens}
    assert attrs["timings"]["total_s"] >= attrs["timings"]["first_token_s"] > 0


def test_a_tiny_temperature_is_greedy_not_a_crash(served):
    """Found by fuzzing: logits / 7.8e-42 overflowed to inf, then NaN, and the engine drew a
    token past the vocabulary. Under ``GREEDY_BELOW`` a temperature is greedy, and recorded so."""
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    tiny = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=7.8e-42)
    greedy = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    assert tiny.choices[0].message.content == greedy.choices[0].message.content
    assert [s.attributes["request"]["sampling"]["temperature"] for s in served.spans(rid, aid)] == [0.0, 0.0]


def test_a_failing_engine_step_fails_its_requests_and_not_the_route(served, monkeypatch):
    """Before, the exception ended the engine's loop: this request and every later one hung."""
    step = served.engine._step
    calls = {"n": 0}

    def fails_once(admit):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return step(admit)

    monkeypatch.setattr(served.engine, "_step", fails_once)
    client = served.client()
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert failed.value.body["code"] == "engine_error" and "RuntimeError: injected" in failed.value.body["message"]
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4).usage.completion_tokens >= 1


@pytest.mark.asyncio
async def test_completion_round_trip_async(served):
    rid, aid = served.new_attempt()
    async with served.async_client(served.server.rollout_base_url(rid, aid)) as client:
        r = await client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=5, logprobs=2, seed=1, temperature=1.0
        )
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == r.usage.completion_tokens and all(
        len(t) <= 2 for t in choice.logprobs.top_logprobs
    )
    [span] = served.spans(rid, aid)
    assert (
        span.name == "llm.completion"
        and span.prompt_token_ids == served.policy.tokenizer("The capital of France is")["input_ids"]
    )
    assert decode(served.policy.tokenizer, reply_ids(span)) == choice.text
    assert span.response_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)


def test_streaming_sync_chat_records_and_reports_usage(served):
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=8,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    texts, finish, usage, ids, logprobs = {0: "", 1: ""}, {}, None, {0: [], 1: []}, {0: [], 1: []}
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            ids[c.index] += c.token_ids
            logprobs[c.index] += [t.logprob for t in (c.logprobs.content if c.logprobs else [])]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    spans = served.spans(rid, aid)
    assert len(spans) == 2 and spans[0].trace_id == spans[1].trace_id  # one span per choice
    by_choice = {s.attributes["choice_index"]: s for s in spans}
    for i in (0, 1):
        assert decode(served.policy.tokenizer, reply_ids(by_choice[i])) == texts[i]
        assert finish[i] == by_choice[i].attributes["finish_reason"]
        assert ids[i] == by_choice[i].response_token_ids
        assert logprobs[i] == pytest.approx(by_choice[i].response_logprobs, abs=1e-5)
    assert usage.completion_tokens == sum(len(s.response_token_ids) for s in spans)


@pytest.mark.asyncio
async def test_streaming_async_completion(served):
    rid, aid = served.new_attempt()
    text = ""
    async with served.async_client(served.server.rollout_base_url(rid, aid)) as client:
        async for chunk in await client.completions.create(
            model=MODEL, prompt=[1, 520, 9531], max_tokens=7, stream=True, logprobs=0
        ):
            text += chunk.choices[0].text
    [span] = served.spans(rid, aid)
    assert span.prompt_token_ids == [1, 520, 9531] and decode(served.policy.tokenizer, reply_ids(span)) == text


# ----------------------------------------------------------------------------- exactness


def test_recorded_logprobs_match_a_teacher_forced_forward_pass(served):
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, temperature=1.0, n=2, seed=7, extra_body={"ignore_eos": True}
    )
    spans = served.spans(rid, aid)
    assert len(spans) == 2 and all(len(s.response_token_ids) == 12 for s in spans)

    async def forward(ids):
        async with served.engine.paused():  # the engine's thread must not use the model meanwhile
            with torch.inference_mode():
                ids_1T = torch.tensor([ids], device=served.policy.device)
                return served.policy.model(input_ids=ids_1T).logits[0].float().cpu()

    for span in spans:
        prompt, response = span.prompt_token_ids, span.response_token_ids
        logits = served.call(forward(prompt + response))
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(1, torch.tensor(response)[:, None])[
            :, 0
        ]
        torch.testing.assert_close(torch.tensor(span.response_logprobs), expected, atol=2e-3, rtol=0)


@pytest.mark.asyncio
async def test_32_concurrent_clients_get_their_own_answers(served):
    """Each client samples with its own seed; served together they get what they get alone."""
    prompts = [[{"role": "user", "content": f"Client {i}: say something about the number {i * 7}."}] for i in range(32)]
    clients = [served.async_client() for _ in prompts]

    async def ask(client, i):
        r = await client.chat.completions.create(
            model=MODEL, messages=prompts[i], max_tokens=8, seed=i, extra_body={"return_token_ids": True}
        )
        return r.choices[0].token_ids, r.choices[0].message.content

    try:
        alone = [await ask(clients[0], i) for i in range(32)]
        together = await asyncio.gather(*(ask(c, i) for i, c in enumerate(clients)))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    assert together == alone
    assert len({tuple(ids) for ids, _ in alone}) == 32  # distinct seeds really give distinct answers


def test_multi_turn_prompt_extends_the_exact_sampled_ids(served):
    """A reply sampled as " " + "hello" must not come back re-tokenized as " hello"."""
    tok = served.policy.tokenizer
    space, hello = tok.encode(" ")[0], tok.encode("hello")[0]
    assert tok.encode(" hello") != [space, hello]
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    with forced_tokens(served, [space, hello]):
        first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
    assert first.choices[0].message.content == " hello" and first.choices[0].finish_reason == "stop"

    conversation = USER + [{"role": "assistant", "content": " hello"}, {"role": "user", "content": "Again?"}]
    client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=3)
    span1, span2 = served.spans(rid, aid)
    assert span1.response_token_ids == [space, hello, EOS]
    exact = span1.prompt_token_ids + span1.response_token_ids
    assert span2.prompt_token_ids[: len(exact)] == exact and span2.attributes["prompt_reused_tokens"] == len(exact)
    assert span2.prompt_token_ids != served.policy.render_chat(conversation)  # what re-rendering would give
    assert decode(tok, span2.prompt_token_ids) == decode(tok, served.policy.render_chat(conversation))

    # a server that did not see the first call (e.g. after a restart) finds it in the store,
    # even behind more metric spans than the history keeps turns
    for i in range(History().turns_per_attempt + 1):
        served.call(
            served.store.add_span(
                Span(
                    rollout_id=rid,
                    attempt_id=aid,
                    name="metric",
                    start_time=0.0,
                    end_time=0.0,
                    attributes={"name": "m", "value": i},
                )
            )
        )
    fresh = ModelServer(served.engine, served.policy, served.store)
    served.call(fresh.start())
    try:
        served.client(fresh.rollout_base_url(rid, aid)).chat.completions.create(
            model=MODEL, messages=conversation, max_tokens=2
        )
    finally:
        served.call(fresh.stop())
    assert served.spans(rid, aid)[-1].prompt_token_ids[: len(exact)] == exact


def test_stop_strings_cut_text_and_cancel(served):
    tok = served.policy.tokenizer
    script = tok.encode(" alpha beta gamma delta epsilon")
    rid, aid = served.new_attempt()
    url = served.server.rollout_base_url(rid, aid)
    with forced_tokens(served, script):
        r = served.client(url).chat.completions.create(model=MODEL, messages=USER, max_tokens=20, stop=["gam", "zzz"])
    assert r.choices[0].message.content == " alpha beta " and r.choices[0].finish_reason == "stop"
    with forced_tokens(served, script):
        chunks = served.client(url).completions.create(model=MODEL, prompt="x", max_tokens=20, stop="a d", stream=True)
        streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == " alpha beta gamm"
    first, second = served.spans(rid, aid)
    assert decode(tok, first.response_token_ids).startswith(" alpha beta gam") and len(first.response_token_ids) < len(
        script
    )
    assert first.attributes["stop_string"] == "gam"
    assert served.idle()


# ----------------------------------------------------------------------------- tools


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a tool with <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


CALL = (
    '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'  # compact: re-rendered JSON would have spaces
)


def test_tools_on_a_model_without_a_tool_template_merge_into_one_sample(served):
    """SmolLM2's template has no tool section: the built-in Hermes prompt is rendered inside it,
    and a tool call -> tool result -> answer conversation is one training sequence."""
    tok = served.policy.tokenizer
    assert not served.policy.supports_tools
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    messages = [{"role": "developer", "content": "Use the tools."}] + USER
    with forced_tokens(served, tok.encode(CALL)):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD_TOOL], max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and call.function.arguments == '{"a":1,"b":2}'  # the model's own text
    [first] = served.spans(rid, aid)
    prompt = decode(tok, first.prompt_token_ids)
    assert first.attributes["chat_template"] == "agl-hermes-tools" and first.attributes["forced_tokens"] == 0
    assert prompt.startswith("<|im_start|>system\nUse the tools.\n\n# Tools\n") and json.dumps(ADD_TOOL) in prompt
    assert prompt.endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )

    conversation = messages + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    with forced_tokens(served, tok.encode("It is 3.")):
        final = client.chat.completions.create(model=MODEL, messages=conversation, tools=[ADD_TOOL], max_tokens=20)
    assert final.choices[0].message.content == "It is 3." and final.choices[0].finish_reason == "stop"
    first, second = served.spans(rid, aid)
    exact = first.prompt_token_ids + first.response_token_ids  # the compact JSON as sampled, not re-rendered
    assert second.prompt_token_ids[: len(exact)] == exact and second.attributes["prompt_reused_tokens"] == len(exact)
    assert (
        decode(tok, second.prompt_token_ids[len(exact) :])
        == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    [sample] = spans_to_samples([first, second], reward=1.0)
    assert sample.prompt_ids == first.prompt_token_ids
    assert sample.num_sampled == len(first.response_token_ids) + len(second.response_token_ids)

    # tool_choice "none": no tools in the prompt, no parsing; the history's call is still rendered as text
    client.chat.completions.create(
        model=MODEL, messages=conversation, tools=[ADD_TOOL], tool_choice="none", max_tokens=2
    )
    third = served.spans(rid, aid)[-1]
    assert (
        "<tools>" not in decode(tok, third.prompt_token_ids) and third.attributes["chat_template"] == "agl-hermes-tools"
    )
    client.chat.completions.create(model=MODEL, messages=USER, tools=[ADD_TOOL], tool_choice="none", max_tokens=2)
    assert served.spans(rid, aid)[-1].attributes["chat_template"] == "model"


def test_tool_choice_required_and_named_force_the_call_without_loss(served):
    tok = served.policy.tokenizer
    rid, aid = served.new_attempt()
    required = tok.encode('<tool_call>\n{"name": "')
    sampled = 'add", "arguments": {"a": 1}}\n</tool_call>'
    with forced_tokens(served, tok.encode(sampled)):
        r = served.client(served.server.rollout_base_url(rid, aid)).chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[ADD_TOOL],
            tool_choice="required",
            max_tokens=40,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
    [call] = r.choices[0].message.tool_calls
    assert (
        call.function.name == "add"
        and json.loads(call.function.arguments) == {"a": 1}
        and r.choices[0].finish_reason == "tool_calls"
    )
    [span] = served.spans(rid, aid)
    assert span.attributes["forced_tokens"] == len(required) and span.prompt_token_ids[-len(required) :] == required
    assert r.prompt_token_ids == span.prompt_token_ids and r.usage.prompt_tokens == len(span.prompt_token_ids)
    assert decode(tok, reply_ids(span)) == sampled  # the forced start is not a sampled token
    assert len(span.response_logprobs) == len(span.response_token_ids) == len(r.choices[0].logprobs.content)

    # max_tokens inside the call: still a call, but "length"; after a complete call: "tool_calls"
    for script, max_tokens, finish in (
        (sampled, 8, "length"),
        (sampled + " and then more", len(tok.encode(sampled)) + 2, "tool_calls"),
    ):
        with forced_tokens(served, tok.encode(script)):
            cut = served.client().chat.completions.create(
                model=MODEL, messages=USER, tools=[ADD_TOOL], tool_choice="required", max_tokens=max_tokens
            )
        assert cut.choices[0].finish_reason == finish and cut.choices[0].message.tool_calls[0].function.name == "add"

    # the next call, served by a route that knows the first one from its span only, forces a named function
    conversation = USER + [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "1"},
    ]
    fresh = ModelServer(served.engine, served.policy, served.store)
    served.call(fresh.start())
    try:
        with forced_tokens(served, tok.encode(' {"a": 5}}\n</tool_call>')):
            named = served.client(fresh.rollout_base_url(rid, aid)).chat.completions.create(
                model=MODEL,
                messages=conversation,
                tools=[ADD_TOOL],
                tool_choice={"type": "function", "function": {"name": "add"}},
                max_tokens=40,
            )
    finally:
        served.call(fresh.stop())
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 5}
    first, second = served.spans(rid, aid)
    forced = tok.encode('<tool_call>\n{"name": "add", "arguments":')
    assert second.attributes["forced_tokens"] == len(forced) and second.prompt_token_ids[-len(forced) :] == forced
    exact = first.prompt_token_ids + first.response_token_ids
    assert second.prompt_token_ids[: len(exact)] == exact
    [sample] = spans_to_samples([first, second], reward=1.0)  # forced tokens: prompt, then glue; never loss
    glue = len(second.prompt_token_ids) - len(exact)
    assert sample.prompt_ids == first.prompt_token_ids and sample.prompt_ids[-len(required) :] == required
    # the grammar of a forced call (agl.route.structure) forces some tokens outright: those carry no loss either
    chosen = [[int(n != 1) for n in span.attributes["constraint"]["allowed"]] for span in (first, second)]
    assert sample.mask == chosen[0] + [0] * glue + chosen[1]
    assert 0 < sum(chosen[0]) < len(first.response_token_ids)  # e.g. `"arguments": ` is forced, the name is not

    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(
            model=MODEL, messages=USER, tools=[ADD_TOOL], tool_choice={"type": "function", "function": {"name": "sub"}}
        )
    assert err.value.body["param"] == "tool_choice" and "'sub' is not in 'tools'" in err.value.message


def test_streamed_tool_calls_arrive_in_pieces_and_add_up_to_the_whole(served):
    tok = served.policy.tokenizer
    said = 'Adding.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    with forced_tokens(served, tok.encode(said)):
        whole = (
            served.client()
            .chat.completions.create(model=MODEL, messages=USER, tools=[ADD_TOOL], max_tokens=60)
            .choices[0]
            .message
        )
    rid, aid = served.new_attempt()
    with forced_tokens(served, tok.encode(said)):
        chunks = list(
            served.client(served.server.rollout_base_url(rid, aid)).chat.completions.create(
                model=MODEL,
                messages=USER,
                tools=[ADD_TOOL],
                max_tokens=60,
                stream=True,
                logprobs=True,
                extra_body={"return_token_ids": True},
            )
        )
    deltas = [c.delta for chunk in chunks for c in chunk.choices]
    at = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert (
        "".join(d.content or "" for d in deltas[:at]) == whole.content == "Adding."
    )  # text before the call is content
    head, *fragments = [tc for d in deltas for tc in d.tool_calls or []]
    assert (head.index, head.type, head.function.name, head.function.arguments) == (
        0,
        "function",
        "add",
        "",
    ) and head.id.startswith("call_")
    assert len(fragments) > 2 and all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    assert (
        "".join(f.function.arguments for f in fragments) == whole.tool_calls[0].function.arguments == '{"a": 1, "b": 2}'
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    [span] = served.spans(rid, aid)
    assert span.attributes["tool_calls"][0]["id"] == head.id  # recorded as streamed
    assert [t for chunk in chunks for c in chunk.choices for t in c.token_ids] == span.response_token_ids
    streamed_logprobs = [
        t.logprob for chunk in chunks for c in chunk.choices for t in (c.logprobs.content if c.logprobs else [])
    ]
    assert streamed_logprobs == pytest.approx(span.response_logprobs, abs=1e-5)

    # the SDK's stream helper assembles the message the non-streaming call returns
    with forced_tokens(served, tok.encode(said)):
        with served.client().chat.completions.stream(
            model=MODEL, messages=USER, tools=[ADD_TOOL], max_tokens=60
        ) as stream:
            assembled = stream.get_final_completion().choices[0]
    assert assembled.finish_reason == "tool_calls" and assembled.message.content == whole.content
    assert [(c.function.name, c.function.arguments) for c in assembled.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]


def test_bad_input_is_answered_the_openai_way(served):
    client = served.client()
    rid, aid = served.new_attempt()
    developer = [{"role": "developer", "content": "Be brief."}] + USER
    served.client(served.server.rollout_base_url(rid, aid)).chat.completions.create(
        model=MODEL, messages=developer, max_tokens=1
    )
    [span] = served.spans(rid, aid)
    assert span.prompt_token_ids == served.policy.render_chat([{"role": "system", "content": "Be brief."}] + USER)

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=USER + [{"role": "tool", "content": "3"}], max_tokens=1)
    assert err.value.body["param"] == "messages.1.tool_call_id" and err.value.body["type"] == "invalid_request_error"

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=1)
    assert err.value.body["code"] == "model_not_found" and "gpt-4o" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)

    for image in (
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_image", "image_url": "https://example.com/a.png"},
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}],
                max_tokens=1,
            )
        assert "Images are not supported" in err.value.message and err.value.body["param"] == "messages.0.content"

    helper = ModelServer(served.engine, served.policy, model_names=["helper"])  # names a later feature registers
    served.call(helper.start())
    try:
        assert [m.id for m in served.client(helper.base_url).models.list().data] == [MODEL, "helper"]
        assert (
            served.client(helper.base_url)
            .chat.completions.create(model="helper", messages=USER, max_tokens=1)
            .usage.completion_tokens
            == 1
        )
    finally:
        served.call(helper.stop())


@pytest.fixture
def hermes(served):
    tokenizer = served.policy.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = HERMES_TEMPLATE
    try:
        yield
    finally:
        tokenizer.chat_template = original


def test_tool_call_round_trip_with_a_tools_template(served, hermes):
    tok = served.policy.tokenizer
    said = 'Adding.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    rid, aid = served.new_attempt()
    client = served.client(served.server.rollout_base_url(rid, aid))
    with forced_tokens(served, tok.encode(said)):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=[ADD_TOOL], max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    [span] = served.spans(rid, aid)
    assert (
        "<tools>" in decode(tok, span.prompt_token_ids)
        and span.attributes["tool_calls"][0]["function"]["name"] == "add"
    )

    # the agent runs the tool and sends the result back: the prompt extends the exact ids
    conversation = USER + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    with forced_tokens(served, tok.encode("It is 3.")):
        final = client.chat.completions.create(model=MODEL, messages=conversation, tools=[ADD_TOOL], max_tokens=20)
    assert final.choices[0].message.content == "It is 3." and final.choices[0].finish_reason == "stop"
    first, second = served.spans(rid, aid)
    exact = first.prompt_token_ids + first.response_token_ids
    assert second.prompt_token_ids[: len(exact)] == exact and "<tool_response>\n3\n</tool_response>" in decode(
        tok, second.prompt_token_ids
    )

    assert first.attributes["chat_template"] == "model"
    with forced_tokens(served, tok.encode(said)):
        chunks = list(
            served.client().chat.completions.create(
                model=MODEL, messages=USER, tools=[ADD_TOOL], max_tokens=60, stream=True
            )
        )
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert [tc.function.name for tc in calls if tc.function.name] == ["add"] and chunks[-1].choices[
        0
    ].finish_reason == "tool_calls"


# ----------------------------------------------------------------------------- policy updates


def test_pause_update_resume_changes_the_recorded_policy_version(served):
    rid, aid = served.new_attempt()
    before = served.policy.version
    client = served.async_client(served.server.rollout_base_url(rid, aid))

    async def update_while_a_request_waits():
        request = asyncio.ensure_future(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3))
        async with served.engine.paused():
            await asyncio.sleep(0.3)
            assert not request.done()  # held until the update is done
            with torch.no_grad():
                lora_b = next(p for name, p in served.policy.model.named_parameters() if "lora_B" in name)
                lora_b.add_(0.01 * torch.randn_like(lora_b))
            served.policy.version += 1
        return await request

    served.call(update_while_a_request_waits())
    served.client(served.server.rollout_base_url(rid, aid)).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2
    )
    assert [s.attributes["policy_version"] for s in served.spans(rid, aid)] == [before + 1, before + 1]


# ----------------------------------------------------------------------------- errors


def test_unknown_and_finished_attempts(served):
    rid, aid = served.new_attempt()
    with pytest.raises(openai.NotFoundError):
        served.client(served.server.rollout_base_url("no-such-rollout", aid)).chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1
        )
    with pytest.raises(openai.NotFoundError) as err:
        served.client(served.server.rollout_base_url(rid, "no-such-attempt")).completions.create(
            model=MODEL, prompt="x", max_tokens=1
        )
    assert err.value.body["code"] == "attempt_not_found"

    served.call(served.store.update_attempt(rid, aid, status="unresponsive"))  # may come back: still served
    served.client(served.server.rollout_base_url(rid, aid)).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1
    )
    assert len(served.spans(rid, aid)) == 1
    served.call(served.store.update_attempt(rid, aid, status="succeeded"))
    with pytest.raises(openai.ConflictError):
        served.client(served.server.rollout_base_url(rid, aid)).chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1
        )
    served.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=1)  # unscoped: served, not recorded
    assert len(served.spans(rid, aid)) == 1


def test_bad_requests_get_openai_errors(served):
    url = served.server.base_url
    cases = [
        ("/chat/completions", b"{oops", 400),
        ("/chat/completions", json.dumps({"messages": []}).encode(), 400),
        ("/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
        ("/chat/completions", json.dumps({"messages": USER, "n": 0}).encode(), 400),
        ("/chat/completions", json.dumps({"messages": USER, "max_tokens": -3}).encode(), 400),
        ("/chat/completions", json.dumps({"messages": USER, "temperature": 3}).encode(), 400),
        ("/completions", json.dumps({"prompt": [10**9]}).encode(), 400),
        ("/nope", b"{}", 404),
    ]
    for path, body, status in cases:
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (path, body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=2040)
    prompt_len = len(served.policy.render_chat(USER))
    assert f"{prompt_len} in the prompt, 2040 in the completion" in err.value.message and "2048" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 2100}])
    assert "context length of 2048" in err.value.message


def test_disconnected_clients_free_their_slots(served):
    rid, aid = served.new_attempt()
    url = served.server.rollout_base_url(rid, aid) + "/chat/completions"
    long = {"messages": USER, "max_tokens": 1900, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", url, json={**long, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break  # one token arrived; now hang up
        assert served.engine.num_running + served.engine.num_waiting <= 1
    assert served.idle(), "a streaming client that left still holds its slot"
    with httpx.Client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post(url, json=long)
    assert served.idle(), "a client that timed out still holds its slot"
    assert served.spans(rid, aid) == []  # nothing the agent never saw is recorded


# ----------------------------------------------------------------------------- fuzz

text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)  # lone surrogates too
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
    """Usually a valid value, sometimes junk: most requests get far enough to generate."""
    return st.integers(0, 7).flatmap(lambda k: junk if k == 7 else valid)


part = st.one_of(
    st.fixed_dictionaries({"type": mostly(st.just("text")), "text": mostly(text)}),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["image_url", "input_image"]),
            "image_url": st.just({"url": "data:image/png;base64,AAAA"}),
        }
    ),
)
tool_call = st.fixed_dictionaries(
    {
        "id": st.just("c1"),
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.just("add"), "arguments": mostly(st.just('{"a": 1}'))}),
    }
)
message = st.fixed_dictionaries(
    {
        "role": mostly(st.sampled_from(["user", "system", "developer", "assistant", "tool"])),
        "content": mostly(st.one_of(text, st.lists(part, max_size=2))),
    },
    optional={
        "tool_calls": mostly(st.lists(tool_call, max_size=1)),
        "tool_call_id": mostly(st.just("c1")),
        "name": mostly(text),
    },
)
sampling = {
    "temperature": mostly(st.floats(0, 2)),
    "top_p": mostly(st.floats(0.01, 1)),
    "n": mostly(st.integers(1, 3)),
    "stop": mostly(st.one_of(text, st.lists(text, max_size=3))),
    "seed": mostly(st.integers(0, 2**40)),
    "stream": st.booleans(),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "return_token_ids": mostly(st.booleans()),
    "ignore_eos": mostly(st.booleans()),
    "frequency_penalty": junk,
}
chat_body = st.fixed_dictionaries(
    {"messages": mostly(st.lists(message, min_size=1, max_size=3)), "max_tokens": mostly(st.integers(1, 3))},
    optional={
        **sampling,
        "max_completion_tokens": mostly(st.integers(1, 3)),
        "logprobs": mostly(st.booleans()),
        "top_logprobs": mostly(st.integers(0, 5)),
        "tools": mostly(st.just([ADD_TOOL])),
        "tool_choice": mostly(
            st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "add"}}])
        ),
        "model": mostly(st.sampled_from([MODEL, "gpt-4o"])),
    },
)
completion_body = st.fixed_dictionaries(
    {
        "prompt": mostly(
            st.one_of(
                text, st.lists(st.integers(0, 49151), min_size=1, max_size=4), st.lists(text, min_size=1, max_size=1)
            )
        ),
        "max_tokens": mostly(st.integers(1, 3)),
    },
    optional={**sampling, "logprobs": mostly(st.integers(0, 5)), "echo": junk},
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    request=st.one_of(
        st.tuples(st.just("/chat/completions"), chat_body), st.tuples(st.just("/completions"), completion_body)
    )
)
def test_fuzzed_requests_never_get_a_server_error(served, request):
    path, body = request
    if (
        isinstance(body.get("max_tokens"), int)
        and body["max_tokens"] > 3
        or not isinstance(body.get("max_tokens"), int)
    ):
        body["max_tokens"] = 2  # junk max_tokens would mean a long default generation; keep it short
    raw = json.dumps(body).encode()  # NaN/Infinity become non-standard tokens, which the server must reject or parse
    r = httpx.post(
        served.server.base_url + path, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT
    )
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)
    else:
        assert "server_error" not in r.text and ("data: [DONE]" in r.text) == (body.get("stream") is True)
