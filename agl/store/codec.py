"""Conversion between the pydantic records of `agl.types` and SQLite rows.

Kept apart from the store logic so that the column lists (which must match
`schema.sql`) and the binary formats live in one place:

* JSON columns are written with `json.dumps`, falling back to pydantic's
  `to_jsonable_python` so models, dates, enums and numpy scalars work.
  Non-finite floats (NaN, inf) are written as null: SQLite's JSON functions
  reject them, and one NaN reward would otherwise break every view.
* Rows are read by column name (`sqlite3.Row`, see db.py), never by position.
* Token ids are packed as little-endian int32 and logprobs as little-endian
  float32 with the `array` module: 4 bytes a token, one BLOB per array, and
  `length(blob)/4` is the token count in plain SQL.
"""

from __future__ import annotations

import json
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from pydantic_core import to_jsonable_python

from agl.types import Attempt, AttemptedRollout, Rollout, RolloutConfig, Span

_SWAP = sys.byteorder != "little"
if array("i").itemsize != 4 or array("f").itemsize != 4:  # pragma: no cover - exotic platforms
    raise ImportError("agl.store needs 4-byte C int and float for its token arrays")


def dumps(value: Any) -> str:
    try:
        return json.dumps(value, default=to_jsonable_python, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN/inf somewhere (rare): redo with them as null
        return json.dumps(_finite(to_jsonable_python(value)), separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps_or_none(value: Any) -> Optional[str]:
    return None if value is None else dumps(value)


def loads_or_none(text: Optional[str]) -> Any:
    return None if text is None else json.loads(text)


def _pack(typecode: str, values: Optional[Sequence[Any]], what: str) -> Optional[bytes]:
    if values is None:
        return None
    try:
        packed = array(typecode, values)
    except OverflowError as exc:
        raise ValueError(f"{what} must fit in int32: {exc}") from None
    if _SWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, blob: Optional[bytes]) -> Optional[list[Any]]:
    if blob is None:
        return None
    values = array(typecode)
    values.frombytes(blob)
    if _SWAP:  # pragma: no cover - big-endian hosts
        values.byteswap()
    return values.tolist()


def pack_token_ids(ids: Optional[Sequence[int]]) -> Optional[bytes]:
    return _pack("i", ids, "token ids")


def unpack_token_ids(blob: Optional[bytes]) -> Optional[list[int]]:
    return _unpack("i", blob)


def pack_logprobs(values: Optional[Sequence[float]]) -> Optional[bytes]:
    return _pack("f", values, "logprobs")


def unpack_logprobs(blob: Optional[bytes]) -> Optional[list[float]]:
    return _unpack("f", blob)


# -- ids -----------------------------------------------------------------------


def numbered_id(prefix: str, number: int) -> str:
    """`ro-000001`: the store's ids number rows in its own order (see txn.py)."""
    return f"{prefix}-{number:06d}"


# -- rollouts ------------------------------------------------------------------

ROLLOUT_COLUMNS = (
    "rollout_id, input, mode, resources_id, status, config, metadata, start_time, end_time, "
    "num_attempts, last_span_seq, queue_seq"
)
"""Columns read for a rollout (`RolloutRow`)."""
ROLLOUT_FIELDS = tuple(ROLLOUT_COLUMNS.split(", "))


class RolloutRow:
    """A `rollouts` row, read by column name: a `sqlite3.Row` of ROLLOUT_COLUMNS, or any
    mapping with the columns the status rules read (rollout_id, status, config,
    num_attempts), such as the row `add_span` selects."""

    __slots__ = ("row", "_config")

    def __init__(self, row: Mapping[str, Any]):
        self.row = row
        self._config: Optional[RolloutConfig] = None

    @property
    def rollout_id(self) -> str:
        return self.row["rollout_id"]

    @property
    def status(self) -> str:
        return self.row["status"]

    @property
    def config(self) -> RolloutConfig:
        if self._config is None:
            self._config = RolloutConfig.model_validate_json(self.row["config"])
        return self._config

    @property
    def num_attempts(self) -> int:
        return self.row["num_attempts"]

    def to_model(self, **override: Any) -> Rollout:
        return Rollout.model_validate(self._fields(override))

    def to_attempted(self, attempt: Attempt, **override: Any) -> AttemptedRollout:
        fields = self._fields(override)
        fields["attempt"] = attempt
        return AttemptedRollout.model_validate(fields)

    def _fields(self, override: dict[str, Any]) -> dict[str, Any]:
        r = self.row
        fields = {
            "rollout_id": r["rollout_id"],
            "input": loads_or_none(r["input"]),
            "mode": r["mode"],
            "resources_id": r["resources_id"],
            "status": r["status"],
            "config": self.config,  # parsed once per row (the rules may have read it already)
            "metadata": loads_or_none(r["metadata"]),
            "start_time": r["start_time"],
            "end_time": r["end_time"],
        }
        fields.update(override)
        return fields


# -- attempts ------------------------------------------------------------------

ATTEMPT_COLUMNS = (
    "rollout_id, attempt_id, sequence_id, status, start_time, end_time, worker_id, "
    "last_heartbeat_time, metadata, session_id, timeout_at, deadline"
)
"""Columns read for an attempt; the last two let a read-only store apply R6 in memory (overdue.py)."""


def attempt_from_row(r: Mapping[str, Any]) -> Attempt:
    return Attempt(
        rollout_id=r["rollout_id"],
        attempt_id=r["attempt_id"],
        sequence_id=r["sequence_id"],
        status=r["status"],
        start_time=r["start_time"],
        end_time=r["end_time"],
        worker_id=r["worker_id"],
        last_heartbeat_time=r["last_heartbeat_time"],
        metadata=loads_or_none(r["metadata"]),
        session_id=r["session_id"],
    )


# -- spans ---------------------------------------------------------------------

SPAN_COLUMNS = (
    "rollout_id, attempt_id, sequence_id, span_id, trace_id, parent_id, name, start_time, "
    "end_time, attributes, prompt_token_ids, response_token_ids, response_logprobs"
)
SPAN_PLACEHOLDERS = ", ".join("?" * 13)


def span_params(span: Span, sequence_id: int) -> tuple[Any, ...]:
    return (
        span.rollout_id,
        span.attempt_id,
        sequence_id,
        span.span_id,
        span.trace_id,
        span.parent_id,
        span.name,
        span.start_time,
        span.end_time,
        dumps(span.attributes),
        pack_token_ids(span.prompt_token_ids),
        pack_token_ids(span.response_token_ids),
        pack_logprobs(span.response_logprobs),
    )


def span_from_row(r: Mapping[str, Any]) -> Span:
    return Span(
        rollout_id=r["rollout_id"],
        attempt_id=r["attempt_id"],
        sequence_id=r["sequence_id"],
        span_id=r["span_id"],
        trace_id=r["trace_id"],
        parent_id=r["parent_id"],
        name=r["name"],
        start_time=r["start_time"],
        end_time=r["end_time"],
        attributes=json.loads(r["attributes"]),
        prompt_token_ids=unpack_token_ids(r["prompt_token_ids"]),
        response_token_ids=unpack_token_ids(r["response_token_ids"]),
        response_logprobs=unpack_logprobs(r["response_logprobs"]),
    )
