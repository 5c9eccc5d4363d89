"""The route fuzzed from its own OpenAPI document (schemathesis), on the tiny model over real HTTP.

Requests are generated from ``GET /openapi.json`` (``agl.route.openapi``), valid ones and, half the
time, ones schemathesis makes invalid on purpose; some get the ``add`` tool and a ``tool_choice``
laid over them, and half go to a rollout attempt's route, where they are recorded. Every answer must:

  - never be a 5xx (``not_a_server_error``);
  - have a documented status and content type, and conform to the documented schema
    (``status_code_conformance``, ``content_type_conformance``, ``response_schema_conformance``): so
    every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}``;
  - streamed, be events that each conform to the document's event schema (schemathesis reads the JSON
    of each ``data:`` line) and end as the API ends a stream (``[DONE]``; ``response.completed`` /
    ``incomplete``) or with an error;
  - recorded, have spans that hold what was returned: one per choice, whose text (and tool calls,
    and token ids when asked for) is the answer's, and whose sampled ids decode to that text.

The number of examples is small in the suite; ``AGL_FUZZ_EXAMPLES=<n>`` (``bench/fuzz_route.py``)
runs n per endpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from agl.policy.engine import Engine
from agl.policy.load import load_policy
from agl.route.openapi import DONE
from agl.route.rendering import decode
from agl.route.server import ModelServer
from agl.store import SqliteStore

TIMEOUT = 60
MODEL = "tiny"  # the policy's name
SCALE = int(os.environ.get("AGL_FUZZ_EXAMPLES", "0"))  # 0: the suite's bounded run
MAX_TOKENS = 4  # what the fuzz lets one choice sample: the point is the route, not generation
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
CHAT_TOOL_CHOICES = ["none", "auto", "required", {"type": "function", "function": {"name": "add"}}]
RESPONSES_TOOL = {"type": "function", "name": "add", "parameters": ADD_TOOL["function"]["parameters"]}
RESPONSES_TOOL_CHOICES = ["none", "auto", "required", {"type": "function", "name": "add"}]


class LiveRoute:
    """Engine, store and route on an event loop of their own (a daemon thread), as in the harness."""

    def __init__(self, cfg, store_path):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-route-loop", daemon=True)
        self.thread.start()
        self.call(self._start(cfg, store_path))
        self.client = httpx.Client(timeout=TIMEOUT)
        self.session = requests.Session()  # schemathesis sends with requests

    async def _start(self, cfg, store_path):
        self.policy = load_policy(cfg, "cpu")
        self.engine = Engine(self.policy)
        await self.engine.start()
        self.store = SqliteStore(store_path)
        self.server = ModelServer(self.engine, self.policy, self.store, {"default_max_tokens": MAX_TOKENS})
        await self.server.start()

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT)

    def close(self):
        async def stop():
            await self.server.stop()
            await self.engine.stop()
            await self.store.close()

        self.client.close()
        self.session.close()
        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def new_attempt(self) -> tuple[str, str]:
        attempted = self.call(self.store.start_rollout(input={"task": "fuzz"}))
        return attempted.rollout_id, attempted.attempt.attempt_id


@pytest.fixture(scope="module")
def route(tiny_model_cfg, tmp_path_factory):
    live = LiveRoute(tiny_model_cfg, tmp_path_factory.mktemp("fuzz") / "store.sqlite")
    yield live
    live.close()


@pytest.fixture(scope="module")
def api(route):
    """The document as the route publishes it, loaded by schemathesis."""
    config = schemathesis.Config.from_dict({"max-stream-events": 10_000})  # whole streams (its default: 20 events)
    return schemathesis.openapi.from_url(route.server.url + "/openapi.json", config=config)


# ----------------------------------------------------------------------------- the document


def test_every_post_has_a_request_body_schema_and_every_answer_one(route):
    document = route.client.get(route.server.url + "/openapi.json").json()
    posts = {path: methods["post"] for path, methods in document["paths"].items() if "post" in methods}
    assert {p.removeprefix("/rollout/{rollout_id}/attempt/{attempt_id}") for p in posts} == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
    }
    schemas = document["components"]["schemas"]
    for path, post in posts.items():
        body = post["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"]["$ref"], path
        name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert schemas[name]["properties"], path
        assert "422" not in post["responses"], path  # FastAPI's validation answer: never given (400s are)
        for status, answer in post["responses"].items():
            assert answer["content"]["application/json"]["schema"]["$ref"], (path, status)
    error = schemas["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert declared == {part[1:-1] for part in path.split("/") if part.startswith("{")}, (path, method)


# ----------------------------------------------------------------------------- fuzzing


def counts(value: object) -> bool:
    """Whether the route takes ``value`` as a count: an int, or a float with an integer's value (``1418.0``, which
    pydantic takes as 1418), not a bool."""
    return type(value) is int or (type(value) is float and value.is_integer())


def capped(body: object) -> object:
    """Keep valid token counts small (invalid ones stay as generated: they must be refused). Uncapped, a
    streamed ``{"max_tokens": 1418.0, "n": 39.0}`` ran past the events schemathesis reads of a stream (and,
    under load, past the request's timeout)."""
    if isinstance(body, dict):
        for key, cap in (
            ("max_tokens", MAX_TOKENS),
            ("max_completion_tokens", MAX_TOKENS),
            ("max_output_tokens", MAX_TOKENS),
            ("n", 4),
        ):
            if counts(body.get(key)) and body[key] > cap:
                body[key] = cap
    return body


def overlaid(data: st.DataObject, path: str, body: object) -> object:
    """Mostly the served model's name and no ``previous_response_id`` (else mostly 404s); streamed or not,
    half and half; half the time the ``add`` tool and one of the tool choices, over whatever was generated."""
    if not isinstance(body, dict):
        return body
    if "model" in body and data.draw(st.integers(0, 3), label="served model") > 0:
        body = {**body, "model": MODEL}
    if "previous_response_id" in body and data.draw(st.integers(0, 3), label="no previous response") > 0:
        body = {k: v for k, v in body.items() if k != "previous_response_id"}  # else a 404, most of the time
    if not path.endswith("/models"):
        body = {**body, "stream": data.draw(st.booleans(), label="stream")}
    if not data.draw(st.booleans(), label="tools"):
        return body
    if path.endswith("/chat/completions"):
        return {**body, "tools": [ADD_TOOL], "tool_choice": data.draw(st.sampled_from(CHAT_TOOL_CHOICES))}
    if path.endswith("/responses"):
        return {**body, "tools": [RESPONSES_TOOL], "tool_choice": data.draw(st.sampled_from(RESPONSES_TOOL_CHOICES))}
    return body


def send(route: LiveRoute, case, scope: tuple[str, str] | None):
    """The case as schemathesis sends it (its own serialization of valid and invalid bodies), to /v1 or,
    with ``scope``, to that attempt's route."""
    base = route.server.url + (f"/rollout/{scope[0]}/attempt/{scope[1]}" if scope else "")
    return case.call(base_url=base, session=route.session, timeout=TIMEOUT)


def sse_events(response) -> list:
    """The data lines of a stream. SSE breaks lines at CR / LF only: str.splitlines would also break inside the
    JSON at U+2028, U+0085 and the like, which the route sends as they are."""
    lines = re.split(r"\r\n|\r|\n", response.text)
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def check_stream(response, path: str) -> list[dict]:
    """The stream ends as the API ends one (schemathesis has checked each event against the document)."""
    raw = sse_events(response)
    if not path.endswith("/responses"):
        assert raw and (raw[-1] == DONE or "error" in json.loads(raw[-1])), response.text
        raw = [r for r in raw if r != DONE]
    events = [json.loads(r) for r in raw]
    if path.endswith("/responses"):
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "error"), events[-1]
    assert not any("server_error" in json.dumps(e) for e in events), response.text
    return events


def returned_text(span) -> str:
    """What the route returns of a span's text: all of it, or, when the reply was parsed for tool calls
    (and held none), the content without surrounding whitespace (``agl.route.tool_calls``)."""
    text = span.attributes["response_text"]
    return text.strip() if span.attributes["request"].get("tools") else text


def check_spans(route: LiveRoute, scope: tuple[str, str], path: str, body: dict, answer: dict | list) -> None:
    """The attempt's spans hold what the route returned."""
    spans = route.call(route.store.query_spans(*scope))
    tokenizer = route.policy.tokenizer
    stop_ids = set(route.policy.eos_token_ids)
    for span in spans:
        ids = span.response_token_ids
        sampled = ids[:-1] if ids and ids[-1] in stop_ids else ids
        text = span.attributes["response_text"]
        assert decode(tokenizer, sampled).startswith(text), (decode(tokenizer, sampled), text)
        if not span.attributes["stop_string"]:
            assert decode(tokenizer, sampled) == text
    by_choice = {s.attributes["choice_index"]: s for s in spans}
    if path.endswith("/responses"):
        [span] = spans
        if isinstance(answer, list):  # streamed: the final response object
            answer = next(e["response"] for e in reversed(answer) if e["type"].startswith("response."))
        texts = [p["text"] for item in answer["output"] if item["type"] == "message" for p in item["content"]]
        calls = [(i["name"], i["arguments"]) for i in answer["output"] if i["type"] == "function_call"]
        recorded = [(c["function"]["name"], c["function"]["arguments"]) for c in span.attributes["tool_calls"] or []]
        assert calls == recorded
        if not span.attributes["tool_calls"] and not span.attributes["forced_tokens"]:
            assert "".join(texts) == returned_text(span), ("".join(texts), span.attributes)
        return
    chat = path.endswith("/chat/completions")
    choices = answer["choices"] if isinstance(answer, dict) else None
    if choices is None:  # streamed: each choice's deltas, joined
        joined: dict[int, dict] = {}
        for chunk in answer:
            for choice in chunk.get("choices", []):
                part = joined.setdefault(choice["index"], {"text": "", "ids": [], "calls": 0})
                delta = choice.get("delta", {}) if chat else {"content": choice.get("text", "")}
                part["text"] += delta.get("content") or ""
                part["ids"] += choice.get("token_ids") or []
                part["calls"] += len(delta.get("tool_calls") or [])
        choices = [{"index": i, **part} for i, part in joined.items()]
    assert sorted(by_choice) == sorted(c["index"] for c in choices)
    for choice in choices:
        span = by_choice[choice["index"]]
        parsed = chat and (span.attributes["tool_calls"] or span.attributes["forced_tokens"])  # text -> calls
        if "text" in choice and not chat:
            returned = choice["text"]
        elif "message" in choice:
            returned = choice["message"]["content"] or ""
            calls = choice["message"].get("tool_calls") or []
            assert [c["function"] for c in calls] == [c["function"] for c in span.attributes["tool_calls"] or []]
        else:
            returned = choice["text"]
        if not parsed:
            assert returned == returned_text(span), (returned, span.attributes)
        if body.get("return_token_ids") is True and isinstance(answer, dict):
            assert choice["token_ids"] == span.response_token_ids
            assert answer["prompt_token_ids"] == span.prompt_token_ids


def fuzz_one(route, api, data, path: str, method: str = "POST") -> None:
    operation = api[path][method]
    mode = data.draw(st.sampled_from([GenerationMode.POSITIVE, GenerationMode.NEGATIVE]), label="mode")
    case = data.draw(operation.as_strategy(generation_mode=mode), label="case")
    body = case.body = capped(overlaid(data, path, case.body))
    scope = route.new_attempt() if method == "POST" and data.draw(st.booleans(), label="rollout") else None
    response = send(route, case, scope)
    case.validate_response(response, checks=CHECKS)
    assert response.status_code < 500, response.text
    event(f"{mode.value} -> {response.status_code}")
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text
        return
    streamed = response.headers["content-type"][0].startswith("text/event-stream")
    assert not response.stream_cut_short
    answer = check_stream(response, path) if streamed else response.json()
    event("streamed" if streamed else "whole")
    if scope is not None and response.status_code == 200 and isinstance(body, dict):
        check_spans(route, scope, path, body, answer)
        event("recorded spans checked")


def fuzz_settings(examples: int):
    return settings(
        max_examples=SCALE or examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        print_blob=True,
    )


@fuzz_settings(40)
@given(data=st.data())
def test_fuzzed_chat_completions(route, api, data):
    fuzz_one(route, api, data, "/v1/chat/completions")


@fuzz_settings(30)
@given(data=st.data())
def test_fuzzed_responses(route, api, data):
    fuzz_one(route, api, data, "/v1/responses")


@fuzz_settings(15)
@given(data=st.data())
def test_fuzzed_completions(route, api, data):
    fuzz_one(route, api, data, "/v1/completions")


@fuzz_settings(3)
@given(data=st.data())
def test_fuzzed_models(route, api, data):
    fuzz_one(route, api, data, "/v1/models", "GET")
