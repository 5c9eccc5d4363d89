"""The model route: an OpenAI-compatible HTTP server over the engine, inside the harness process.

Agents talk to the policy through ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/responses`` like any OpenAI endpoint. Under ``/rollout/{rollout_id}/attempt/{attempt_id}/v1``
the same calls are also *recorded*: each sampled choice becomes one span in the store with the exact prompt
token ids, sampled token ids, their log-probs and the policy version that sampled them, which
is what the trainer learns from. Unscoped ``/v1`` calls are served but not recorded, unless the
server is made with ``record_unscoped=True`` (``algo=serve``): then each one is recorded the same
way, as a rollout of its own (``metadata={"served": "chat"}`` or ``"completion"``, no mode, no
input: the span holds the request) whose one attempt succeeds once its spans are stored.

Why in-process: the server runs as a task on the caller's event loop (``uvicorn.Server.serve``),
next to the engine and the store. No second process, no IPC, and the trainer can pause the
engine between steps while the route keeps accepting requests.

Choices worth knowing:
  - n > 1 is one ``engine.submit`` (shared prefill) and writes one span per choice, all with
    the same ``trace_id``: each choice is a separate sample for the trainer.
  - max_tokens, when omitted, is the room left in the context, capped at ``default_max_tokens``
    (1024).
  - Returned text is exactly what was sampled, special tokens included, minus a final stop
    token and anything from a matched stop string on. ``logprobs`` and ``token_ids`` cover
    every sampled token, the final stop token included (it is part of what the trainer sees).
  - Tools work on every model. A model whose chat template has no tool section gets the
    built-in Hermes/Qwen-style tool prompt inside its own template (``agl.tool_prompt``); each
    span's ``chat_template`` attribute says which rendered it ("model" or "agl-hermes-tools").
    Replies are parsed for ``<tool_call>`` blocks (``agl.chat.ToolCallParser``).
  - ``tool_choice`` "required" or a named function is enforced by forcing the start of the
    reply: the tokens of ``<tool_call>\\n{"name": "`` (required) or ``<tool_call>\\n{"name":
    "<fn>", "arguments":`` (named) are appended to the prompt, then the rest is sampled. They
    were not sampled, so they belong to the span's prompt ids (no loss, no logprobs); the span
    says how many (``forced_tokens``) and usage counts them as prompt tokens. The returned
    message is parsed from forced + sampled text, so it is a tool call (unless max_tokens ends
    it before the name does). "none" renders and parses no tools.
  - Streamed tool calls arrive as OpenAI's do: a ``tool_calls`` delta with index, id, type and
    name (empty arguments) as soon as the name is complete, then argument fragments; text
    before a call streams as content.
  - Bad input is answered as OpenAI answers it, never with a 5xx: ``model`` must be the
    policy's name or one of the server's ``model_names`` (else 404 ``model_not_found``; a
    request without ``model`` is served too); a ``developer`` message is a system message to
    the template; a ``tool`` message needs ``tool_call_id``; image parts are a 400 (text only).
  - A rollout call without a ``seed`` samples with one derived from the run seed and the
    call's identity (``agl.seeding.call_seed``), so what it samples does not depend on
    scheduling; the span records the seed used and where it came from. Unscoped calls
    without a seed draw from the engine's shared generator.
  - ``/v1/responses`` (OpenAI's Responses API, the Agents SDK's default) is a chat call in
    disguise: ``agl.responses`` translates the request's items into chat messages, the chat
    path renders, samples, parses tool calls and records (an ``llm.chat`` span whose
    ``request.responses`` holds the response id, ``previous_response_id`` and ``metadata``),
    and the reply goes back as output items, streamed as Responses events or not. Stored
    responses (``store``, the default) stay in memory, the last ``max_stored_responses``, for
    ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``, on the route that made them.
  - A client that disconnects cancels its sequences; nothing is recorded for it.
  - With ``api_key`` set, every route but ``GET /health`` needs ``Authorization: Bearer <key>``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import secrets
import socket
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agl import responses, tool_prompt
from agl.chat import Delta, History, OutputAssembler, ToolCallParser, Turn, decode, render_prompt, template_messages
from agl.engine import SamplingParams, SequenceStream
from agl.openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    conflict,
    error_body,
    model_not_found,
    not_found,
    parse_request,
    unauthorized,
)
from agl.responses import OutputBuilder, ResponsesRequest, ResponseStore, StoredResponse
from agl.seeding import CallCounter, call_seed
from agl.store.rules import charged_attempt_number
from agl.types import Span

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024
FINISHED_ATTEMPT_STATUSES = ("succeeded", "failed", "timeout")  # an "unresponsive" attempt may come back
MIN_LOGPROB = -9999.0  # what OpenAI reports for impossible tokens; JSON has no -Infinity


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: Ctrl-C belongs to the harness, not to the route."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclasses.dataclass
class _Choice:
    index: int
    stream: SequenceStream
    out: OutputAssembler
    finish_reason: str | None = None
    content: str | None = None
    tool_calls: list[dict] = dataclasses.field(default_factory=list)
    tools: ToolCallParser | None = None  # set when the reply is parsed for tool calls
    pending: Delta | None = None  # streamed tokens whose text the tool parser still holds back


@dataclasses.dataclass
class _Call:
    """Everything about one generation request that the response and the spans need."""

    kind: str  # "chat" | "completion"
    req: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    scope: tuple[str, str] | None  # (rollout_id, attempt_id) when recorded
    tools: list[dict] | None  # tools given to the template (and parsed back), if any
    reused_tokens: int
    seed: int | None  # the request's own, or derived for a rollout call (None: unscoped, unseeded)
    received_at: float  # perf_counter at arrival
    received_wall: float  # time.time() at arrival
    template: str | None = None  # chat: which template rendered the prompt (agl.tool_prompt.MODEL / BUILTIN)
    forced_ids: list[int] = dataclasses.field(default_factory=list)  # the prompt's last ids: a forced reply start
    forced_text: str = ""  # their text, where the parsed reply begins
    api_request: dict | None = None  # a Responses call: its id, previous_response_id, metadata (recorded)
    id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(12))
    choices: list[_Choice] = dataclasses.field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.out.token_ids) for c in self.choices)

    def usage(self) -> dict:
        prompt = len(self.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens, "total_tokens": prompt + self.completion_tokens}


class _ClientGone(Exception):
    pass


class ModelServer:
    """OpenAI-compatible route over ``engine`` on the caller's event loop.

    The engine's lifecycle is the caller's: start it before serving, stop it after ``stop()``.

    >>> server = ModelServer(engine, policy, store)     # doctest: +SKIP
    >>> await server.start(); server.base_url            # doctest: +SKIP
    'http://127.0.0.1:40321/v1'
    """

    def __init__(
        self,
        engine: Any,
        policy: Any,
        store: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        seed: int = 0,
        model_names: Sequence[str] = (),
        max_stored_responses: int = 1024,
        record_unscoped: bool = False,
    ):
        self.engine = engine
        self.policy = policy
        self.store = store
        self.host = host
        self.port = port
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        self.seed = seed  # the run seed: rollout calls without a seed of their own derive one from it
        # what requests may name in `model`: the policy, and names registered for it (e.g. helper models)
        self.model_names = tuple(dict.fromkeys([policy.name, *model_names]))
        self.history = History()
        self.responses = ResponseStore(max_stored_responses)  # for previous_response_id (Responses API)
        self.call_numbers = CallCounter()
        if record_unscoped and store is None:
            raise ValueError("record_unscoped needs a store to record into")
        self.record_unscoped = record_unscoped  # /v1 calls too: each one a rollout of its own
        self.app = self._build_app()
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def rollout_base_url(self, rollout_id: str, attempt_id: str) -> str:
        return f"{self.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"

    async def start(self) -> None:
        """Bind (port 0 picks a free port, known right away) and serve as a task on this loop."""
        if self._task is not None:
            return
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        self._server = _EmbeddedUvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="agl-model-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise why it could not start
                raise RuntimeError("the model server stopped during startup")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = self._server = None

    # ------------------------------------------------------------------ app

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="agl model route", docs_url=None, redoc_url=None, openapi_url=None)
        router = APIRouter(dependencies=[Depends(self._authorize)])
        router.add_api_route("/models", self._models, methods=["GET"])
        router.add_api_route("/chat/completions", self._chat, methods=["POST"])
        router.add_api_route("/completions", self._completions, methods=["POST"])
        router.add_api_route("/responses", self._responses, methods=["POST"])
        router.add_api_route("/responses/{response_id}", self._get_response, methods=["GET"])
        router.add_api_route("/responses/{response_id}", self._delete_response, methods=["DELETE"])
        app.include_router(router, prefix="/v1")
        app.include_router(router, prefix="/rollout/{rollout_id}/attempt/{attempt_id}/v1")
        app.add_api_route("/health", self._health, methods=["GET"])

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(RequestValidationError)
        async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
            return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
            return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
            log.exception("unexpected error serving %s", request.url.path)
            return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)

        return app

    async def _authorize(self, request: Request) -> None:
        if self.api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise unauthorized()

    async def _health(self) -> dict:
        return {
            "status": "ok",
            "model": self.policy.name,
            "policy_version": self.policy.version,
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
        }

    async def _models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "agl", "max_model_len": self.policy.context_length}
                for name in self.model_names
            ],
        }

    # ------------------------------------------------------------------ endpoints

    async def _chat(self, request: Request) -> Response:
        received_at, received_wall = time.perf_counter(), time.time()
        req = parse_request(ChatCompletionRequest, await request.body())
        self._check_model(req.model)
        scope, seed = await self._check_scope(request, req.seed)
        call = await self._chat_call(req, scope, seed, received_at, received_wall)
        return await self._generate(request, call)

    async def _chat_call(
        self, req: ChatCompletionRequest, scope: tuple[str, str] | None, seed: int | None, received_at: float, received_wall: float
    ) -> _Call:
        """A chat request rendered to prompt ids (tool prompt, exact prefixes, forced reply start)."""
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if use_tools else None
        messages = template_messages(req.messages)
        turns = await self._turns(scope) if scope else ()
        template = tool_prompt.MODEL
        if tool_prompt.needs_builtin(self.policy.supports_tools, messages, tools):
            messages, template = tool_prompt.builtin_messages(messages, tools, [t.reply_text for t in turns]), tool_prompt.BUILTIN
        try:
            prompt = render_prompt(self.policy, messages, tools if template == tool_prompt.MODEL else None, turns)
        except Exception as exc:  # jinja errors: roles that must alternate, missing fields, ...
            raise bad_request(f"The chat template could not render these messages: {exc}", param="messages") from None
        forced_text = tool_prompt.forced_prefix(req.tool_choice_json) if use_tools else ""
        forced = self.policy.tokenizer.encode(forced_text, add_special_tokens=False) if forced_text else []
        return _Call(
            "chat", req, prompt.ids + forced, scope, tools, prompt.reused, seed, received_at, received_wall,
            template=template, forced_ids=forced, forced_text=decode(self.policy.tokenizer, forced),
        )

    async def _completions(self, request: Request) -> Response:
        received_at, received_wall = time.perf_counter(), time.time()
        req = parse_request(CompletionRequest, await request.body())
        self._check_model(req.model)
        scope, seed = await self._check_scope(request, req.seed)
        if isinstance(req.prompt, str):
            prompt_ids = self.policy.tokenizer(req.prompt)["input_ids"]
        else:
            vocab = len(self.policy.tokenizer)
            if max(req.prompt) >= vocab:
                raise bad_request(f"Token id {max(req.prompt)} is out of range (vocabulary size {vocab}).", param="prompt")
            prompt_ids = list(req.prompt)
        if not prompt_ids:
            raise bad_request("The prompt is empty.", param="prompt")
        call = _Call("completion", req, list(prompt_ids), scope, None, 0, seed, received_at, received_wall)
        return await self._generate(request, call)

    async def _responses(self, request: Request) -> Response:
        """``POST /v1/responses``: translated to a chat call, answered as a Responses object (``agl.responses``)."""
        received_at, received_wall = time.perf_counter(), time.time()
        req = parse_request(ResponsesRequest, await request.body())
        self._check_model(req.model)
        previous: list = []
        if req.previous_response_id is not None:
            stored = self.responses.get(req.previous_response_id, _scope_key(request))
            if stored is None:
                raise responses.not_stored(req.previous_response_id, "previous_response_id")
            previous = stored.items + stored.output
        items = previous + responses.parse_items(req.input)
        chat_req = responses.to_chat_request(req, items, first_new=len(previous))
        scope, seed = await self._check_scope(request, req.seed)
        response_id = responses.new_id("resp")
        try:
            call = await self._chat_call(chat_req, scope, seed, received_at, received_wall)
            call.api_request = {"api": "responses", "id": response_id, "previous_response_id": req.previous_response_id, "metadata": req.metadata, "store": req.store is not False}
            self._submit(call)
        except APIError as exc:
            raise responses.for_responses(exc) from None
        state = _ResponseState(response_id, req, items, int(received_wall))
        builder = OutputBuilder((lambda delta: self._logprobs(call, delta)["content"]) if chat_req.logprobs else None)
        if req.stream:
            return StreamingResponse(self._responses_sse(call, state, builder), media_type="text/event-stream")
        try:
            await _unless_disconnected(request, self._run_response(call, builder))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            call.choices[0].stream.cancel()
        return JSONResponse(await self._finish_response(call, state, builder))

    async def _get_response(self, request: Request, response_id: str) -> dict:
        stored = self.responses.get(response_id, _scope_key(request))
        if stored is None:
            raise responses.not_stored(response_id, None)
        return stored.body

    async def _delete_response(self, request: Request, response_id: str) -> dict:
        if not self.responses.delete(response_id, _scope_key(request)):
            raise responses.not_stored(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise model_not_found(model, self.model_names)

    async def _check_scope(self, request: Request, seed: int | None) -> tuple[tuple[str, str] | None, int | None]:
        """(rollout_id, attempt_id) of a rollout route, after 404 / 409 checks (None if unscoped),
        and the call's sampling seed: ``seed`` if given, else derived for a rollout call."""
        rollout_id = request.path_params.get("rollout_id")
        if rollout_id is None:
            return None, seed
        attempt_id = request.path_params["attempt_id"]
        if self.store is None:
            raise not_found("This server has no store, so rollout routes are unavailable; use /v1.")
        if await self.store.get_rollout_by_id(rollout_id) is None:
            raise not_found(f"Rollout '{rollout_id}' does not exist.", code="rollout_not_found")
        attempts = await self.store.query_attempts(rollout_id)
        attempt = next((a for a in attempts if a.attempt_id == attempt_id), None)
        if attempt is None:
            raise not_found(f"Attempt '{attempt_id}' of rollout '{rollout_id}' does not exist.", code="attempt_not_found")
        if attempt.status in FINISHED_ATTEMPT_STATUSES:
            raise conflict(f"Attempt '{attempt_id}' of rollout '{rollout_id}' already finished ({attempt.status}).", code="attempt_finished")
        scope = (rollout_id, attempt_id)
        call_number = self.call_numbers.next(scope)
        if seed is None:
            seed = call_seed(self.seed, rollout_id, charged_attempt_number(attempts, attempt), call_number)
        return scope, seed

    async def _turns(self, scope: tuple[str, str]) -> list[Turn]:
        """Earlier turns of this attempt: from memory, else (e.g. after a restart) from its spans."""
        turns = self.history.get(scope)
        if turns is None:
            calls = [
                s for s in await self.store.query_spans(*scope)
                if s.name == "llm.chat" and s.prompt_token_ids and s.response_token_ids is not None
            ]
            turns = [_turn_of(self.policy.tokenizer, s) for s in calls[-self.history.turns_per_attempt:]]  # the last chat turns
            self.history.load(scope, turns)
        return turns

    # ------------------------------------------------------------------ generation

    def _sampling_params(self, call: _Call) -> SamplingParams:
        req, prompt_len, context = call.req, len(call.prompt_ids), self.policy.context_length
        room = context - prompt_len
        if req.token_limit is None:
            if room < 1:
                raise bad_request(
                    f"The prompt has {prompt_len} tokens, which leaves no room in the model's context length of {context} tokens.",
                    param="messages" if call.kind == "chat" else "prompt",
                    code="context_length_exceeded",
                )
            max_tokens = min(self.default_max_tokens, room)
        elif prompt_len + req.token_limit > context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_len + req.token_limit} tokens ({prompt_len} in the prompt, {req.token_limit} in the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            max_tokens = req.token_limit
        if req.n > self.engine.max_batch_size:
            raise bad_request(f"n={req.n} exceeds the engine's batch size ({self.engine.max_batch_size}).", param="n")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=call.seed,
            top_logprobs=req.n_top_logprobs,
            ignore_eos=req.ignore_eos,
        )

    def _submit(self, call: _Call) -> None:
        """Check the token budget, submit the call's sequences to the engine and set up its choices."""
        params = self._sampling_params(call)
        streams = self.engine.submit(call.prompt_ids, params, n=call.req.n)
        tokenizer, stops = self.policy.tokenizer, call.req.stop_strings
        call.choices = [
            _Choice(i, s, OutputAssembler(tokenizer, stops, s.stop_ids, top_logprobs=params.top_logprobs > 0), tools=ToolCallParser() if call.tools else None)
            for i, s in enumerate(streams)
        ]

    async def _generate(self, request: Request, call: _Call) -> Response:
        self._submit(call)
        if call.req.stream:
            return StreamingResponse(self._sse(call), media_type="text/event-stream")
        try:
            await _unless_disconnected(request, asyncio.gather(*(self._run_choice(call, c) for c in call.choices)))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            for choice in call.choices:
                choice.stream.cancel()
        for choice in call.choices:
            if choice.tools is not None:
                choice.tools.feed(call.forced_text + choice.out.text)
                self._settle_tools(choice)
        await self._record(call)
        return JSONResponse(self._response(call))

    async def _run_choice(self, call: _Call, choice: _Choice, on_delta: Callable[[_Choice, Delta], Awaitable[None]] | None = None) -> None:
        """Consume one sequence's tokens until it ends or a stop string matches."""
        out = choice.out
        async for event in choice.stream:
            out.add(event.token_id, event.logprob, event.top_logprobs)
            if out.stop_matched:
                choice.stream.cancel()  # free the slot now; later tokens are never seen
                break
            if on_delta is not None:
                delta = out.release()
                if delta.text:
                    await on_delta(choice, delta)
        if not out.stop_matched:
            await choice.stream.wait()
            out.finish()
        if choice.stream.finish_reason == "abort" and not out.stop_matched:
            raise APIError(503, "The engine stopped before this request finished.", "server_error", code="engine_stopped")
        choice.finish_reason = "stop" if out.stop_matched else choice.stream.finish_reason
        choice.content = out.text

    async def _run_response(self, call: _Call, builder: OutputBuilder, emit: Callable[[list[dict]], Awaitable[None]] | None = None) -> None:
        """Run a Responses call's one choice, building its output items; ``emit`` gets the stream events."""
        choice = call.choices[0]

        def parsed(text: str) -> list[dict]:
            if choice.tools is not None:
                return choice.tools.feed(text)
            return [{"content": text}] if text else []

        async def on_delta(_: _Choice, delta: Delta) -> None:
            events = builder.feed(parsed(delta.text), delta)
            if emit is not None and events:
                await emit(events)

        if choice.tools is not None and call.forced_text:  # forced text: where the parsed reply begins
            await on_delta(choice, Delta(call.forced_text, [], [], None))
        await self._run_choice(call, choice, on_delta)
        final = choice.out.release(final=True)
        deltas = parsed(final.text) + (self._settle_tools(choice) if choice.tools is not None else [])
        events = builder.feed(deltas, final) + builder.finish(incomplete=choice.finish_reason == "length")
        if emit is not None:
            await emit(events)

    async def _finish_response(self, call: _Call, state: "_ResponseState", builder: OutputBuilder) -> dict:
        """Record the call, build the final response object and keep it for ``previous_response_id``."""
        await self._record(call)
        completed = call.choices[0].finish_reason != "length"
        body = responses.response_body(
            state.id, state.req, self.policy.name, state.created_at, "completed" if completed else "incomplete", builder.items,
            responses.usage(len(call.prompt_ids), call.completion_tokens), completed_at=int(time.time()) if completed else None,
        )
        if state.req.store is not False:
            self.responses.put(state.id, StoredResponse(call.scope, state.items, responses.output_items(builder.items), body))
        return body

    async def _responses_sse(self, call: _Call, state: "_ResponseState", builder: OutputBuilder) -> AsyncIterator[str]:
        """A Responses stream: created, in_progress, the output items' events, then completed (or incomplete)."""
        numbers = itertools.count()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        def event(body: dict) -> str:
            body = {**body, "sequence_number": next(numbers)}
            return f"event: {body['type']}\n{_sse_line(body)}"

        async def run() -> None:
            try:
                await self._run_response(call, builder, queue.put)
            except Exception as exc:
                await queue.put(exc)
            finally:
                await queue.put(done)

        task = None
        try:
            opening = responses.response_body(state.id, state.req, self.policy.name, state.created_at, "in_progress", [])
            yield event({"type": "response.created", "response": opening})
            yield event({"type": "response.in_progress", "response": opening})
            task = asyncio.create_task(run())
            while (item := await queue.get()) is not done:
                if isinstance(item, Exception):
                    raise item
                for body in item:
                    yield event(body)
            final = await self._finish_response(call, state, builder)
            yield event({"type": f"response.{final['status']}", "response": final})
        except APIError as exc:
            yield event({"type": "error", "code": exc.code or exc.type, "message": exc.message, "param": exc.param})
        except Exception as exc:
            log.exception("unexpected error while streaming a response")
            yield event({"type": "error", "code": "server_error", "message": f"Internal server error: {type(exc).__name__}: {exc}", "param": None})
        finally:
            if task is not None:
                task.cancel()
            call.choices[0].stream.cancel()

    @staticmethod
    def _settle_tools(choice: _Choice) -> list[dict]:
        """The reply's text is all fed to its tool parser: take the content and calls from it."""
        deltas = choice.tools.finish()
        choice.content, choice.tool_calls = choice.tools.content, choice.tools.calls
        if choice.tool_calls and not choice.tools.cut_in_call:  # a call cut short by max_tokens stays "length"
            choice.finish_reason = "tool_calls"
        return deltas

    async def _sse(self, call: _Call) -> AsyncIterator[str]:
        """Server-sent events of a streamed call; choices run concurrently into one queue."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def emit(choice: _Choice, delta: Delta) -> None:
            if choice.tools is None:
                await queue.put(self._chunk(call, choice, delta, finish_reason=None))
            else:
                for chunk in self._tool_chunks(call, choice, delta, choice.tools.feed(delta.text)):
                    await queue.put(chunk)

        async def run(choice: _Choice) -> None:
            try:
                if choice.tools is not None and call.forced_text:  # forced text: its deltas come first
                    await emit(choice, Delta(call.forced_text, [], [], None if choice.out.top_logprobs is None else []))
                await self._run_choice(call, choice, emit)
                final = choice.out.release(final=True)
                if choice.tools is None:
                    await queue.put(self._chunk(call, choice, final, choice.finish_reason))
                else:
                    deltas = choice.tools.feed(final.text) + self._settle_tools(choice)
                    for chunk in self._tool_chunks(call, choice, final, deltas):
                        await queue.put(chunk)
                    await queue.put(self._chunk(call, choice, choice.pending or _no_tokens(final), choice.finish_reason, message={}))
            except Exception as exc:
                await queue.put(exc)
            finally:
                await queue.put(done)

        tasks = []
        try:
            for choice in call.choices:
                yield _sse_line(self._chunk(call, choice, None, None))  # the role / first chunk
            tasks = [asyncio.create_task(run(choice)) for choice in call.choices]
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield _sse_line(item)
            await self._record(call)
            if call.req.include_usage:
                yield _sse_line({**self._envelope(call, chunk=True), "choices": [], "usage": call.usage()})
            yield "data: [DONE]\n\n"
        except APIError as exc:
            yield _sse_line(exc.body())
        except Exception as exc:
            log.exception("unexpected error while streaming")
            yield _sse_line(error_body(f"Internal server error: {type(exc).__name__}: {exc}", "server_error"))
        finally:
            for task in tasks:
                task.cancel()
            for choice in call.choices:
                choice.stream.cancel()

    # ------------------------------------------------------------------ responses

    def _envelope(self, call: _Call, chunk: bool = False) -> dict:
        if call.kind == "chat":
            obj, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return {"id": prefix + call.id, "object": obj, "created": int(call.received_wall), "model": self.policy.name}

    def _response(self, call: _Call) -> dict:
        choices = []
        for choice in call.choices:
            out = choice.out
            delta = Delta(choice.content or "", out.token_ids, out.logprobs, out.top_logprobs)
            if call.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": choice.content}
                if choice.tool_calls:
                    message["tool_calls"] = choice.tool_calls
                item = {"index": choice.index, "message": message, "logprobs": self._logprobs(call, delta), "finish_reason": choice.finish_reason}
            else:
                item = {"index": choice.index, "text": out.text, "logprobs": self._logprobs(call, delta), "finish_reason": choice.finish_reason}
            if call.req.return_token_ids:
                item["token_ids"] = out.token_ids
            choices.append(item)
        body = {**self._envelope(call), "choices": choices, "usage": call.usage()}
        if call.req.return_token_ids:
            body["prompt_token_ids"] = call.prompt_ids
        return body

    def _tool_chunks(self, call: _Call, choice: _Choice, delta: Delta, messages: list[dict]) -> list[dict]:
        """One chunk per tool-parser delta (content, a call, an argument fragment); the tokens
        consumed so far travel with the first. Tokens whose text is still held back wait."""
        tokens = delta if choice.pending is None else _joined(choice.pending, delta)
        if not messages:
            choice.pending = tokens
            return []
        choice.pending = None
        return [self._chunk(call, choice, tokens if i == 0 else _no_tokens(tokens), None, message) for i, message in enumerate(messages)]

    def _chunk(self, call: _Call, choice: _Choice, delta: Delta | None, finish_reason: str | None, message: dict | None = None) -> dict:
        """One streamed chunk; ``delta=None`` is the opening chunk of a choice. ``message``
        replaces the chat delta's ``{"content": delta.text}`` (tool calls)."""
        body = self._envelope(call, chunk=True)
        if call.kind == "chat":
            if delta is None:
                content: dict[str, Any] = {"role": "assistant", "content": ""}
            elif message is not None:
                content = message
            else:
                content = {"content": delta.text}
            item = {"index": choice.index, "delta": content}
        else:
            item = {"index": choice.index, "text": delta.text if delta else ""}
        item["logprobs"] = self._logprobs(call, delta) if delta else None
        item["finish_reason"] = finish_reason
        if call.req.return_token_ids:
            item["token_ids"] = delta.token_ids if delta else []
            if delta is None and choice.index == 0:
                body["prompt_token_ids"] = call.prompt_ids
        body["choices"] = [item]
        return body

    def _logprobs(self, call: _Call, delta: Delta) -> dict | None:
        """OpenAI's logprobs object for the tokens of ``delta`` (chat or legacy completion shape)."""
        if not call.req.wants_logprobs:
            return None
        tokenizer = self.policy.tokenizer
        texts = [decode(tokenizer, [t]) for t in delta.token_ids]
        tops = delta.top_logprobs or [[] for _ in delta.token_ids]
        if call.kind == "chat":
            return {
                "content": [
                    {
                        "token": text,
                        "logprob": _finite(lp),
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {"token": (alt := decode(tokenizer, [tid])), "logprob": _finite(alp), "bytes": list(alt.encode())} for tid, alp in top
                        ],
                    }
                    for text, lp, top in zip(texts, delta.logprobs, tops)
                ],
                "refusal": None,
            }
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [_finite(lp) for lp in delta.logprobs],
            "top_logprobs": [{decode(tokenizer, [tid]): _finite(alp) for tid, alp in top} for top in tops] if call.req.n_top_logprobs else None,
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ recording

    async def _record(self, call: _Call) -> None:
        """One span per choice (same trace_id) for a rollout call; remember chat turns for prefix reuse.

        An unscoped call is recorded only with ``record_unscoped``, into a rollout made for it now
        (nothing is made for a call that failed or whose client left), and finished right after.
        """
        if call.scope is None and not self.record_unscoped:
            return
        if call.scope is None:
            served = await self.store.start_rollout(input=None, metadata={"served": call.kind})
            rollout_id, attempt_id = served.rollout_id, served.attempt.attempt_id
        else:
            rollout_id, attempt_id = call.scope
        req = call.req
        sampling = {
            "max_tokens": call.choices[0].stream.params.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "n": req.n,
            "seed": call.seed,
            "seed_from": "request" if req.seed is not None else "derived" if call.seed is not None else "engine",  # engine: its shared generator (unscoped)
            "stop": req.stop_strings,
            "top_logprobs": req.n_top_logprobs,
            "ignore_eos": req.ignore_eos,
        }
        if call.kind == "chat":
            request = {"messages": [m.model_dump(exclude_none=True) for m in req.messages], "tools": call.tools, "tool_choice": req.tool_choice_json, "sampling": sampling}
            if call.api_request is not None:
                request["responses"] = call.api_request
        else:
            request = {"prompt": req.prompt, "sampling": sampling}
        trace_id = secrets.token_hex(16)
        prompt_text = decode(self.policy.tokenizer, call.prompt_ids) if call.kind == "chat" else ""
        for choice in call.choices:
            stream, out = choice.stream, choice.out
            attributes = {
                "policy_version": stream.policy_version,
                "model": self.policy.name,
                "request": request,
                "choice_index": choice.index,
                "finish_reason": choice.finish_reason,
                "stop_string": out.stop_matched,
                "response_text": out.text,
                "tool_calls": choice.tool_calls or None,
                "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(out.token_ids)},
                "prompt_reused_tokens": call.reused_tokens,
                "timings": _timings(call, stream),
            }
            if call.kind == "chat":
                attributes["chat_template"] = call.template
                attributes["forced_tokens"] = len(call.forced_ids)
            span = Span(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                trace_id=trace_id,
                name=f"llm.{call.kind}",
                start_time=call.received_wall,
                end_time=call.received_wall + ((stream.finished_at or time.perf_counter()) - call.received_at),
                attributes=attributes,
                prompt_token_ids=call.prompt_ids,
                response_token_ids=out.token_ids,
                response_logprobs=out.logprobs,
            )
            await self.store.add_span(span)
            if call.kind == "chat" and call.scope is not None:
                self.history.add(call.scope, Turn(call.prompt_ids, out.token_ids, prompt_text, call.forced_text + out.text))
        if call.scope is None:
            await self.store.update_attempt(rollout_id, attempt_id, status="succeeded")


@dataclasses.dataclass
class _ResponseState:
    """What a Responses call's response object needs besides the chat call."""

    id: str
    req: ResponsesRequest
    items: list  # the whole conversation's input items (previous response's included)
    created_at: int


def _scope_key(request: Request) -> tuple[str, str] | None:
    """(rollout_id, attempt_id) of a rollout route, unchecked; None on /v1."""
    rollout_id = request.path_params.get("rollout_id")
    return None if rollout_id is None else (rollout_id, request.path_params["attempt_id"])


def _turn_of(tokenizer: Any, span: Span) -> Turn:
    """The turn a recorded chat span was: its reply text is its forced tokens' text + the returned text."""
    forced = span.attributes.get("forced_tokens") or 0
    reply = (decode(tokenizer, span.prompt_token_ids[-forced:]) if forced else "") + (span.attributes.get("response_text") or "")
    return Turn(list(span.prompt_token_ids), list(span.response_token_ids), decode(tokenizer, span.prompt_token_ids), reply)


def _joined(first: Delta, then: Delta) -> Delta:
    tops = None if first.top_logprobs is None else first.top_logprobs + (then.top_logprobs or [])
    return Delta(first.text + then.text, first.token_ids + then.token_ids, first.logprobs + then.logprobs, tops)


def _no_tokens(like: Delta) -> Delta:
    return Delta("", [], [], None if like.top_logprobs is None else [])


def _timings(call: _Call, stream: SequenceStream) -> dict:
    """Seconds: render (arrival -> submit), queue (submit -> prefill starts), prefill (-> first token), total."""
    end = stream.finished_at or time.perf_counter()
    first = stream.first_token_at
    admitted = getattr(stream, "admitted_at", None)
    return {
        "render_s": stream.submitted_at - call.received_at,
        "queue_s": None if admitted is None else admitted - stream.submitted_at,
        "prefill_s": None if admitted is None or first is None else first - admitted,
        "first_token_s": None if first is None else first - stream.submitted_at,
        "total_s": end - call.received_at,
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise ``_ClientGone``.

    The body has been read, so the next ASGI message can only be the disconnect.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(work)
    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not work.done()
        if gone:  # the client left, or this handler itself is being cancelled
            work.cancel()
            work.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it now
    if gone:
        raise _ClientGone()
    return work.result()
