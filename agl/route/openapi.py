"""The route's OpenAPI document (``GET /openapi.json``), built from the models that parse and answer.

The POST handlers read the raw body and parse it themselves (``agl.route.requests.parse_request``), so
every bad input is a 400 in OpenAI's shape rather than FastAPI's 422. FastAPI therefore sees no body
parameter and would document none; this module documents what the handlers really take and answer:

  - each POST's request body is its request model's JSON schema (``ChatCompletionRequest``,
    ``CompletionRequest``, ``ResponsesRequest``; lenient: unknown fields are allowed, as served);
  - each answer is its response model's (``agl.route.response_models``), in pydantic's validation mode:
    a field that is left out when None (``Omitted``) is optional and nullable there, as on the wire;
  - a streamed answer (``text/event-stream``) is described event by event, as OpenAPI 3.2 does before
    ``itemSchema``: an object whose ``data`` is JSON (``contentMediaType``) of the stream's event model
    (``contentSchema``), or chat's closing ``[DONE]``;
  - every error status the route answers carries ``ErrorResponse``
    (``{"error": {"message", "type", "param", "code"}}``); FastAPI's 422 is never answered, so it is
    left out, and the rollout routes' path parameters, which the handlers read from the request,
    are declared.

``tests/test_route_fuzz.py`` and ``bench/fuzz_route.py`` generate requests from this document
(schemathesis) and hold the answers to it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, RootModel
from pydantic.json_schema import models_json_schema

from agl.route.requests import ChatCompletionRequest, CompletionRequest
from agl.route.response_models import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    DeletedResponse,
    ErrorEvent,
    ErrorResponse,
    Health,
    ModelList,
    Response,
    ResponseEvent,
    _ArgumentsEvent,
    _ItemEvent,
    _TextEvent,
)
from agl.route.responses_api import ITEM_MODELS, ResponsesRequest

REF_TEMPLATE = "#/components/schemas/{model}"
DONE = "[DONE]"  # the last data line of a chat or text completion stream


def sse_schema(event: dict, done: bool) -> dict:
    """One server-sent event whose ``data`` is JSON matching ``event`` (or, with ``done``, the closing line)."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": event}
    return {
        "type": "object",
        "properties": {"event": {"type": "string"}, "data": {"anyOf": [data, {"const": DONE}]} if done else data},
        "required": ["data"],
    }


class ChatStreamEvent(RootModel[Union[ChatCompletionChunk, ErrorResponse]]):
    """One ``data:`` line of a streamed chat completion (before ``[DONE]``): a chunk, or the error that ended it."""


class CompletionStreamEvent(RootModel[Union[CompletionChunk, ErrorResponse]]):
    """One ``data:`` line of a streamed text completion: a chunk, or the error that ended it."""


class ResponseStreamEvent(RootModel[Union[ResponseEvent, _ItemEvent, _TextEvent, _ArgumentsEvent, ErrorEvent]]):
    """One ``data:`` line of a streamed Responses call (each also carries its ``sequence_number``)."""


@dataclasses.dataclass(frozen=True)
class Operation:
    """What one endpoint takes and answers, for its OpenAPI entry."""

    summary: str
    answer: type[BaseModel]
    request: type[BaseModel] | None = None
    stream: type[BaseModel] | None = None  # the schema of a streamed answer's events
    errors: tuple[int, ...] = (400, 401, 404, 409, 413)


OPERATIONS = {
    "chat": Operation("Chat completion (OpenAI)", ChatCompletion, ChatCompletionRequest, ChatStreamEvent),
    "completions": Operation("Text completion (OpenAI)", Completion, CompletionRequest, CompletionStreamEvent),
    "responses": Operation("Response (OpenAI's Responses API)", Response, ResponsesRequest, ResponseStreamEvent),
    "get_response": Operation("A stored response", Response, errors=(401, 404)),
    "delete_response": Operation("Delete a stored response", DeletedResponse, errors=(401, 404)),
    "models": Operation("The models this route serves", ModelList, errors=(401,)),
    "health": Operation("Liveness, the policy version and the engine's load (no key needed)", Health, errors=()),
}
ERRORS = {
    400: "Bad input (OpenAI's invalid_request_error, naming the param)",
    401: "Missing or wrong API key",
    404: "Unknown model, rollout, attempt or stored response",
    409: "The attempt already finished",
    413: "The request body is over server.max_request_bytes",
    503: "The engine stopped before the request finished, or the run's disk is full (code disk_full)",
}


@functools.cache
def _schemas() -> tuple[dict, dict]:
    """(model -> its ``$ref``, every component schema), for all models the document names.

    ``ResponsesRequest.input`` is typed loosely (``list[Any]``: ``parse_items`` validates each item
    itself, so an error names the item's index); its documented schema lists the item models."""
    models = {
        m
        for op in OPERATIONS.values()
        for m in (op.answer, op.request, op.stream, ErrorResponse)
        if m is not None  # one model once: models_json_schema names each once
    } | set(ITEM_MODELS.values())
    keys, defs = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: (m.__module__, m.__name__))],
        ref_template=REF_TEMPLATE,
    )
    refs = {model: ref for (model, _), ref in keys.items()}
    components = defs.get("$defs", {})
    responses_request = components[refs[ResponsesRequest]["$ref"].rsplit("/", 1)[1]]
    responses_request["properties"]["input"] = {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"anyOf": [refs[m] for m in ITEM_MODELS.values()]}},
            {"type": "null"},
        ],
        "default": None,
        "title": "Input",
    }
    return refs, components


def ref(model: type[BaseModel]) -> dict:
    return dict(_schemas()[0][model])


def route_docs(name: str) -> dict[str, Any]:
    """Keyword arguments for ``add_api_route``: the operation's summary, answers and request body."""
    op = OPERATIONS[name]
    ok: dict[str, Any] = {"application/json": {"schema": ref(op.answer)}}
    if op.stream is not None:
        ok["text/event-stream"] = {"schema": sse_schema(ref(op.stream), done=op.stream is not ResponseStreamEvent)}
    responses: dict[int | str, dict] = {200: {"description": "OK", "content": ok}}
    for status in (*op.errors, 503) if op.request is not None else op.errors:
        responses[status] = {
            "description": ERRORS[status],
            "content": {"application/json": {"schema": ref(ErrorResponse)}},
        }
    extra = (
        {"requestBody": {"required": True, "content": {"application/json": {"schema": ref(op.request)}}}}
        if op.request is not None
        else {}
    )
    return {"summary": op.summary, "responses": responses, "openapi_extra": extra}


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document of ``app``, completed as the module docstring says (built once, then cached)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(_schemas()[1])
    for component in ("HTTPValidationError", "ValidationError"):
        doc["components"]["schemas"].pop(component, None)
    for path, methods in doc.get("paths", {}).items():
        for operation in methods.values():
            operation.get("responses", {}).pop("422", None)
            for answer in operation.get("responses", {}).values():
                for media in answer.get("content", {}).values():  # FastAPI's own guess beside ours: ours only
                    if "$ref" in media.get("schema", {}):
                        media["schema"] = {"$ref": media["schema"]["$ref"]}
            declared = {p["name"] for p in operation.get("parameters", []) if p.get("in") == "path"}
            missing = [name for name in re.findall(r"{(\w+)}", path) if name not in declared]
            operation.setdefault("parameters", []).extend(
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in missing
            )
            if not operation["parameters"]:
                del operation["parameters"]
    app.openapi_schema = doc
    return doc
