"""The model route: an OpenAI-compatible HTTP server over the engine, inside the harness process.

Agents talk to the policy through ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/responses`` like any OpenAI endpoint. Under ``/rollout/{rollout_id}/attempt/{attempt_id}/v1``
the same calls are also *recorded*: each sampled choice becomes one span with the exact token
ids and log-probs the trainer learns from (``agl.route.recording``). Unscoped ``/v1`` calls are served
but not recorded, unless the server is made with ``record_unscoped=True`` (``algo=serve``).

This module is the transport: routes, auth, OpenAI-style errors, streaming and disconnects. What the
endpoints share, from a request's checks to its recorded spans (prompt, engine, tool calls), is the chat
path, ``agl.route.chat_path.ChatPath``; the Responses endpoints (``agl.route.responses_endpoint``) use it
as the chat endpoints here do. Requests are parsed by ``agl.route.requests`` and answered with the models of
``agl.route.response_models``; prompts are rendered by ``agl.route.rendering`` (``agl.route.tool_prompt``
for tools), and Responses calls translated to chat calls by ``agl.route.responses_api``.

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
    built-in Hermes/Qwen-style tool prompt inside its own template (``agl.route.tool_prompt``); each
    span's ``chat_template`` attribute says which rendered it ("model" or "agl-hermes-tools").
    Replies are parsed for ``<tool_call>`` blocks (``agl.route.tool_calls.ToolCallParser``).
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
  - Structured replies (docs/structured-outputs.md): ``response_format`` (``json_object``,
    ``json_schema``), forced or ``strict`` tool calls and ``parallel_tool_calls: false`` become a
    grammar (``agl.route.structure``) the engine samples under: every reply that ends by the
    grammar's own end is valid; one cut by ``max_tokens`` ends with ``finish_reason: "length"``.
    Its span records the grammar and, per token, how many tokens it allowed (``constraint``).
  - ``/v1/responses`` (OpenAI's Responses API, the Agents SDK's default) is a chat call in
    disguise: ``agl.route.responses_api`` translates the request's items into chat messages, the chat
    path renders, samples, parses tool calls and records (an ``llm.chat`` span whose
    ``request.responses`` holds the response id, ``previous_response_id`` and ``metadata``),
    and the reply goes back as output items, streamed as Responses events or not. Stored
    responses (``store``, the default) stay in memory, the last ``server.stored_responses``, for
    ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``, on the route that made them.
  - A client that disconnects cancels its sequences; nothing is recorded for it.
  - With ``api_key`` set, every route but ``GET /health`` and ``GET /openapi.json`` (the document of
    the API, ``agl.route.openapi``) needs ``Authorization: Bearer <key>``. A
    non-loopback ``host`` without one is refused unless ``allow_public`` (``check_server_exposure``).
  - Limits (docs/reliability.md): a request body over ``max_request_bytes`` (4 MiB) is a 413,
    refused while it arrives; ``max_tokens`` past the context length (prompt included) is a 400
    (``context_length_exceeded``), and so is a prompt that fills it; ``n`` is at most the engine's
    batch, ``top_logprobs`` at most 20, ``stop`` at most 16 strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from agl.config import ServerConfig, check_server_exposure, typed
from agl.errors import DiskFull
from agl.route.chat_path import ChatPath
from agl.route.openapi import openapi_document, route_docs
from agl.route.output import Delta
from agl.route.recording import Call, Choice, Recorder
from agl.route.rendering import History
from agl.route.requests import APIError, ChatCompletionRequest, CompletionRequest, disk_full, error_body, unauthorized
from agl.route.response_models import Answer, ModelCard, ModelList
from agl.route.responses_endpoint import ResponsesEndpoint
from agl.route.streaming import ClientGone, interleaved, sse_line, unless_disconnected
from agl.store.server import Embedded, listening_socket

if TYPE_CHECKING:
    from agl.policy.engine import Engine
    from agl.policy.load import Policy
    from agl.store import SqliteStore, StoreClient

log = logging.getLogger(__name__)


class ModelServer:
    """OpenAI-compatible route over ``engine`` on the caller's event loop.

    The engine's lifecycle is the caller's: start it before serving, stop it after ``stop()``.

    Examples:
        >>> server = ModelServer(engine, policy, store)     # doctest: +SKIP
        >>> await server.start(); server.base_url            # doctest: +SKIP
        'http://127.0.0.1:40321/v1'
    """

    def __init__(
        self,
        engine: Engine,
        policy: Policy,
        store: SqliteStore | StoreClient | None = None,
        config: ServerConfig | Mapping[str, Any] | None = None,
        *,
        seed: int = 0,
        model_names: Sequence[str] = (),
        frozen: Mapping[str, Engine] | None = None,
        record_unscoped: bool = False,
    ):
        config = typed(
            ServerConfig, config or {}
        )  # server.*: host, port, api_key, default_max_tokens, history and response store sizes, body size cap
        check_server_exposure(config)  # a public address needs a key (or server.allow_public)
        self.engine = engine
        self.policy = policy
        self.host = config.host
        self.port = config.port  # 0 until start() binds a free one
        self.api_key = config.api_key
        # frozen helper models: name -> an engine sampling the base model (adapter off; agl.policy.sampler_weights)
        frozen = dict(frozen or {})
        recorder = Recorder(
            store,
            policy,
            record_unscoped,
            frozen_names=frozen,
            history=History(config.history_attempts, config.history_turns),
        )
        # the chat machinery every endpoint below shares: checks, prompts, sampling, recording (agl.route.chat_path)
        self.chat = ChatPath(
            engine,
            policy,
            store,
            recorder,
            frozen=frozen,
            model_names=model_names,
            seed=seed,
            default_max_tokens=config.default_max_tokens,
            max_request_bytes=config.max_request_bytes,
        )
        self.responses = ResponsesEndpoint(self.chat, config.stored_responses)  # /v1/responses
        self.app = self._build_app()
        self._serving = Embedded("agl-model-server")

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
        if self._serving.running:
            return
        sock = listening_socket(self.host, self.port)  # TCP_NODELAY on its connections: no 40 ms a reply
        self.port = sock.getsockname()[1]
        await self._serving.start(self.app, sock)

    async def stop(self) -> None:
        """Stop serving, for good: the server lets go of its engines, policy and store. FastAPI keeps every endpoint
        it has seen, bound methods of this server included, in module-level caches (``fastapi.dependencies.models``,
        4,096 entries each), so a stopped server lives on: without this, each job of a sweep run in one process keeps
        the previous jobs' models and samplers (docs/benchmarks-history.md#route-stopped-models)."""
        if not self._serving.running:
            return
        await self._serving.stop()
        self.engine = self.policy = None
        self.chat.release()

    # ------------------------------------------------------------------ app

    def _build_app(self) -> FastAPI:
        app = FastAPI(
            title="agl model route",
            version="v1",
            description="OpenAI-compatible; under /rollout/{rollout_id}/attempt/{attempt_id}/v1 calls are recorded.",
            docs_url=None,
            redoc_url=None,
            openapi_url="/openapi.json",  # agl.route.openapi: the request and response models' schemas
        )
        app.openapi = functools.partial(openapi_document, app)
        router = APIRouter(dependencies=[Depends(self._authorize)])
        router.add_api_route("/models", self._models, methods=["GET"], **route_docs("models"))
        router.add_api_route("/chat/completions", self._chat, methods=["POST"], **route_docs("chat"))
        router.add_api_route("/completions", self._completions, methods=["POST"], **route_docs("completions"))
        router.add_api_route("/responses", self.responses.create, methods=["POST"], **route_docs("responses"))
        router.add_api_route(
            "/responses/{response_id}", self.responses.get, methods=["GET"], **route_docs("get_response")
        )
        router.add_api_route(
            "/responses/{response_id}", self.responses.delete, methods=["DELETE"], **route_docs("delete_response")
        )
        app.include_router(router, prefix="/v1")
        app.include_router(router, prefix="/rollout/{rollout_id}/attempt/{attempt_id}/v1")
        app.add_api_route("/health", self._health, methods=["GET"], **route_docs("health"))

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(DiskFull)  # the store closed under a call (agl/store/db.py): the job is stopping
        async def _disk_full(request: Request, exc: DiskFull) -> JSONResponse:
            return await _api_error(request, disk_full(exc))

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
            return JSONResponse(
                error_body(f"Internal server error: {type(exc).__name__}: {exc}", "server_error"), status_code=500
            )

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
        return ModelList(
            data=[ModelCard(id=name, max_model_len=self.policy.context_length) for name in self.chat.model_names]
        ).model_dump()

    # ------------------------------------------------------------------ endpoints

    async def _chat(self, request: Request) -> Response:
        received_at, received_wall = time.perf_counter(), time.time()
        req = await self.chat.parse(request, ChatCompletionRequest)
        scope, seed = await self.chat.check_scope(request, req.seed)
        call = await self.chat.render(req, scope, seed, received_at, received_wall)
        return await self._generate(request, call)

    async def _completions(self, request: Request) -> Response:
        received_at, received_wall = time.perf_counter(), time.time()
        req = await self.chat.parse(request, CompletionRequest)
        scope, seed = await self.chat.check_scope(request, req.seed)
        call = self.chat.tokenize(req, scope, seed, received_at, received_wall)
        return await self._generate(request, call)

    # ------------------------------------------------------------------ answers, whole or streamed

    async def _generate(self, request: Request, call: Call) -> Response:
        self.chat.submit(call)
        if call.req.stream:
            return StreamingResponse(self._sse(call), media_type="text/event-stream")
        try:
            await unless_disconnected(request, asyncio.gather(*(self.chat.run_choice(c) for c in call.choices)))
        except ClientGone:
            return Response(status_code=499)
        finally:
            for choice in call.choices:
                choice.stream.cancel()
        for choice in call.choices:
            if choice.tools is not None:
                choice.tools.feed(call.forced_text + choice.out.text)
                self.chat.settle_tools(choice)
        await self.chat.record(call)
        answer = Answer(call, self.chat.served_name(call.req.model), self.chat.tokenizer)
        return JSONResponse(answer.whole().model_dump())

    async def _sse(self, call: Call) -> AsyncIterator[str]:
        """Server-sent events of a streamed call; its choices run concurrently."""
        answer = Answer(call, self.chat.served_name(call.req.model), self.chat.tokenizer)

        async def run(choice: Choice, put: Callable[[BaseModel], Awaitable[None]]) -> None:
            async def emit(choice: Choice, delta: Delta) -> None:
                for chunk in answer.chunks(
                    choice, delta, None if choice.tools is None else choice.tools.feed(delta.text)
                ):
                    await put(chunk)

            if choice.tools is not None and call.forced_text:  # forced text: its deltas come first
                await emit(choice, Delta(call.forced_text, [], [], None if choice.out.top_logprobs is None else []))
            await self.chat.run_choice(choice, emit)
            final = choice.out.release(final=True)
            chunks = (
                []
                if choice.tools is None
                else answer.chunks(choice, final, choice.tools.feed(final.text) + self.chat.settle_tools(choice))
            )
            for chunk in chunks + [answer.last(choice, final)]:
                await put(chunk)

        try:
            for choice in call.choices:
                yield sse_line(answer.opening(choice))  # the role / first chunk
            async with contextlib.aclosing(
                interleaved([functools.partial(run, choice) for choice in call.choices])
            ) as chunks:
                async for chunk in chunks:
                    yield sse_line(chunk)
            await self.chat.record(call)
            if call.req.include_usage:
                yield sse_line(answer.usage_chunk())
            yield "data: [DONE]\n\n"
        except APIError as exc:
            yield sse_line(exc.body())
        except Exception as exc:
            log.exception("unexpected error while streaming")
            yield sse_line(error_body(f"Internal server error: {type(exc).__name__}: {exc}", "server_error"))
        finally:
            for choice in call.choices:
                choice.stream.cancel()
