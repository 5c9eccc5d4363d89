"""``/v1/responses``: OpenAI's Responses API served on the chat path, and the stored responses.

A Responses call is a chat call in disguise: ``agl.route.responses_api`` translates its items into chat
messages, the chat path (``agl.route.chat_path.ChatPath``) renders, samples, parses tool calls and records, and
the reply goes back as output items, streamed as Responses events or not. Stored responses (``store``, the
default) stay in memory, the last ``server.stored_responses``, for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``, on the route that made them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from agl.route import responses_api
from agl.route.chat_path import ChatPath
from agl.route.output import Delta
from agl.route.recording import Call, Choice, ResponseStore, StoredResponse
from agl.route.requests import APIError
from agl.route.response_models import DeletedResponse, ErrorEvent, OutputBuilder, ResponseEvent, chat_logprobs, new_id
from agl.route.response_models import Response as ResponseObject
from agl.route.responses_api import ResponsesRequest
from agl.route.streaming import ClientGone, interleaved, scope_key, sse_line, unless_disconnected

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ResponseState:
    """What a Responses call's response object needs besides the chat call."""

    id: str
    req: ResponsesRequest
    items: list  # the whole conversation's input items (previous response's included)
    created_at: int


class ResponsesEndpoint:
    """The Responses API's three endpoints on the route's ``chat`` path, with the responses it stored."""

    def __init__(self, chat: ChatPath, stored_responses: int):
        self.chat = chat
        self.stored = ResponseStore(stored_responses)  # for previous_response_id and GET

    async def create(self, request: Request) -> Response:
        """``POST /v1/responses``: translated to a chat call, answered as a Responses object
        (``agl.route.responses_api``)."""
        received_at, received_wall = time.perf_counter(), time.time()
        req = await self.chat.parse(request, ResponsesRequest)
        previous: list = []
        if req.previous_response_id is not None:
            stored = self.stored.get(req.previous_response_id, scope_key(request))
            if stored is None:
                raise responses_api.not_stored(req.previous_response_id, "previous_response_id")
            previous = stored.items + stored.output
        items = previous + responses_api.parse_items(req.input)
        chat_req = responses_api.to_chat_request(req, items, first_new=len(previous))
        scope, seed = await self.chat.check_scope(request, req.seed)
        response_id = new_id("resp")
        try:
            call = await self.chat.render(chat_req, scope, seed, received_at, received_wall)
            call.api_request = {
                "api": "responses",
                "id": response_id,
                "previous_response_id": req.previous_response_id,
                "metadata": req.metadata,
                "store": req.store is not False,
            }
            self.chat.submit(call)
        except APIError as exc:
            raise responses_api.for_responses(exc) from None
        state = ResponseState(response_id, req, items, int(received_wall))
        builder = OutputBuilder(
            (lambda delta: chat_logprobs(self.chat.tokenizer, delta).content) if chat_req.logprobs else None
        )
        if req.stream:
            return StreamingResponse(self._sse(call, state, builder), media_type="text/event-stream")
        try:
            await unless_disconnected(request, self._run(call, builder))
        except ClientGone:
            return Response(status_code=499)
        finally:
            call.choices[0].stream.cancel()
        return JSONResponse((await self._finish(call, state, builder)).model_dump())

    async def get(self, request: Request, response_id: str) -> dict:
        stored = self.stored.get(response_id, scope_key(request))
        if stored is None:
            raise responses_api.not_stored(response_id, None)
        return stored.body

    async def delete(self, request: Request, response_id: str) -> dict:
        if not self.stored.delete(response_id, scope_key(request)):
            raise responses_api.not_stored(response_id, None)
        return DeletedResponse(id=response_id).model_dump()

    async def _run(
        self, call: Call, builder: OutputBuilder, emit: Callable[[list[dict]], Awaitable[None]] | None = None
    ) -> None:
        """Run a Responses call's one choice, building its output items; ``emit`` gets the stream events."""
        choice = call.choices[0]

        def parsed(text: str) -> list[dict]:
            if choice.tools is not None:
                return choice.tools.feed(text)
            return [{"content": text}] if text else []

        async def on_delta(_: Choice, delta: Delta) -> None:
            events = builder.feed(parsed(delta.text), delta)
            if emit is not None and events:
                await emit(events)

        if choice.tools is not None and call.forced_text:  # forced text: where the parsed reply begins
            await on_delta(choice, Delta(call.forced_text, [], [], None))
        await self.chat.run_choice(choice, on_delta)
        final = choice.out.release(final=True)
        deltas = parsed(final.text) + (self.chat.settle_tools(choice) if choice.tools is not None else [])
        events = builder.feed(deltas, final) + builder.finish(incomplete=choice.finish_reason == "length")
        if emit is not None:
            await emit(events)

    async def _finish(self, call: Call, state: ResponseState, builder: OutputBuilder) -> ResponseObject:
        """Record the call, build the final response object and keep it for ``previous_response_id``."""
        await self.chat.record(call)
        completed = call.choices[0].finish_reason != "length"
        response = responses_api.response_object(
            state.id,
            state.req,
            self.chat.served_name(state.req.model),
            state.created_at,
            "completed" if completed else "incomplete",
            builder.output,
            (len(call.prompt_ids), call.completion_tokens),
            completed_at=int(time.time()) if completed else None,
        )
        if state.req.store is not False:
            body = response.model_dump()
            self.stored.put(
                state.id, StoredResponse(call.scope, state.items, responses_api.output_items(body["output"]), body)
            )
        return response

    async def _sse(self, call: Call, state: ResponseState, builder: OutputBuilder) -> AsyncIterator[str]:
        """A Responses stream: created, in_progress, the output items' events, then completed (or incomplete)."""
        numbers = itertools.count()

        def event(body: BaseModel | dict) -> str:
            body = {**(body.model_dump() if isinstance(body, BaseModel) else body), "sequence_number": next(numbers)}
            return f"event: {body['type']}\n{sse_line(body)}"

        try:
            opening = responses_api.response_object(
                state.id, state.req, self.chat.served_name(state.req.model), state.created_at, "in_progress", []
            )
            yield event(ResponseEvent(type="response.created", response=opening))
            yield event(ResponseEvent(type="response.in_progress", response=opening))
            async with contextlib.aclosing(interleaved([functools.partial(self._run, call, builder)])) as batches:
                async for batch in batches:
                    for body in batch:
                        yield event(body)
            final = await self._finish(call, state, builder)
            yield event(ResponseEvent(type=f"response.{final.status}", response=final))
        except APIError as exc:
            yield event(ErrorEvent(code=exc.code or exc.type, message=exc.message, param=exc.param))
        except Exception as exc:
            log.exception("unexpected error while streaming a response")
            yield event(
                ErrorEvent(
                    code="server_error", message=f"Internal server error: {type(exc).__name__}: {exc}", param=None
                )
            )
        finally:
            call.choices[0].stream.cancel()
