"""The store's API as it crosses the network: which of `SqliteStore`'s methods a client may call, and their
arguments and results on the wire, all derived from the methods themselves.

One source of truth: a method's signature and type hints on `SqliteStore` are its contract (its docstring
says what it does; the status rules are in rules.py). From them this module builds, per method, a pydantic
model of its arguments and a `TypeAdapter` of its result. The server (server.py) validates a request's
JSON body with the first and writes the result with the second; the client (client.py) does the reverse.
Nothing is a second format: records are the pydantic models of `agl.types` (`Rollout`, `Span`,
`Checkpoint`, ...) in their JSON form, bytes (checkpoint blobs) in base64, and non-finite floats as null,
as the store itself writes them (codec.py).

`UNSET` ("leave as is", the update methods' default) is not sent: an argument left out is left out on the
server too, so the store applies its own default.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import typing
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, TypeAdapter, create_model
from pydantic_core import to_jsonable_python

from agl.store.store import SqliteStore
from agl.types import UNSET, Unset

SESSION_HEADER = "X-AGL-Session"  # names the client session a call is made for
MAX_WAIT_S = 30.0  # one wait_for_rollouts request waits at most this long; the client asks again for the rest
KEEPALIVE_S = 20.0  # a client closes a connection idle this long; the server waits longer (server.py)

# The methods a client may call, in the order of SqliteStore's docs. Left out: the lifecycle of the store
# itself (open, close, the watchdog: the server's), and the server-facing session methods (client sessions
# are opened, heartbeated and ended through their own routes: server.py).
METHODS = (
    "enqueue_rollout",
    "enqueue_rollouts",
    "start_rollout",
    "dequeue_rollout",
    "start_attempt",
    "query_rollouts",
    "get_rollout_by_id",
    "update_rollout",
    "query_attempts",
    "get_latest_attempt",
    "update_attempt",
    "add_span",
    "get_next_span_sequence_id",
    "query_spans",
    "wait_for_rollouts",
    "check_timeouts",
    "reap_dead_sessions",
    "session_alive",
    "add_resources",
    "update_resources",
    "get_resources_by_id",
    "get_latest_resources",
    "set_run_info",
    "get_run_info",
    "get_all_run_info",
    "log_metrics",
    "query_metrics",
    "save_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
)

# bytes (checkpoint blobs) travel as base64 text, NaN and infinities as the constants Python's json writes
# (NaN, Infinity): what reaches the store is what the caller gave, and the store writes it as it always does
WIRE = ConfigDict(val_json_bytes="base64", extra="forbid")


def to_json(value: Any) -> bytes:
    """The wire's JSON of plain Python data (records dumped by pydantic in Python mode first): bytes as
    base64, non-finite floats kept."""
    plain = to_jsonable_python(value, bytes_mode="base64", inf_nan_mode="constants")
    return json.dumps(plain, separators=(",", ":")).encode()


def _without_unset(annotation: Any) -> Any:
    """`Union[X, Unset]` -> X: UNSET is expressed by leaving the argument out."""
    if typing.get_origin(annotation) is Union:
        kept = tuple(a for a in typing.get_args(annotation) if a is not Unset)
        return Union[kept] if len(kept) > 1 else kept[0]  # noqa: UP007 (built from a tuple)
    return annotation


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of the API: its signature on `SqliteStore`, its arguments' model and its result's adapter."""

    name: str
    signature: inspect.Signature
    arguments: type[BaseModel]
    result: TypeAdapter
    doc: str

    def encode_arguments(self, bound: dict[str, Any]) -> bytes:
        """The JSON body of a call with these arguments (UNSET ones left out), validated as the server will."""
        given = {name: value for name, value in bound.items() if value is not UNSET}
        model = self.arguments.model_validate(given)
        return to_json(model.model_dump(include=set(given)))  # those given (with a record's defaults: a span's id)

    def decode_arguments(self, body: bytes) -> dict[str, Any]:
        """The keyword arguments of the store's method from a JSON body: only those the client gave, as the
        validated values (a `Span`, bytes), not their dumps."""
        model = self.arguments.model_validate_json(body or b"{}")
        return {name: getattr(model, name) for name in model.model_fields_set}

    def encode_result(self, value: Any) -> bytes:
        return to_json(self.result.dump_python(value))

    def decode_result(self, body: bytes) -> Any:
        return self.result.validate_json(body)


def _method(name: str) -> Method:
    function = getattr(SqliteStore, name)
    hints = typing.get_type_hints(function)
    signature = inspect.signature(function)
    fields: dict[str, Any] = {}
    for parameter in list(signature.parameters.values())[1:]:  # self
        annotation = _without_unset(hints.get(parameter.name, Any))
        default = None if parameter.default in (inspect.Parameter.empty, UNSET) else parameter.default
        fields[parameter.name] = (annotation, ... if parameter.default is inspect.Parameter.empty else default)
    arguments = create_model(f"{name}_arguments", __config__=WIRE, **fields)
    return Method(name, signature, arguments, TypeAdapter(hints.get("return", Any)), inspect.getdoc(function) or "")


@functools.cache
def methods() -> dict[str, Method]:
    """Every method of the API by name (built once, on first use)."""
    return {name: _method(name) for name in METHODS}
