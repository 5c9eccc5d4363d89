"""Conversion between the pydantic records of `agl.types` and SQLite rows.

Kept apart from the store logic so that the column lists (which must match
`schema.sql`) and the binary formats live in one place:

* JSON columns are written with `json.dumps`, falling back to pydantic's
  `to_jsonable_python` so models, dates, enums and numpy scalars work.
  Non-finite floats (NaN, inf) are written as null: SQLite's JSON functions
  reject them, and one NaN reward would otherwise break every view.
* Token ids are packed as little-endian int32 and logprobs as little-endian
  float32 with the `array` module: 4 bytes a token, one BLOB per array, and
  `length(blob)/4` is the token count in plain SQL.
"""

from __future__ import annotations

import json
import math
import sys
from array import array
from typing import Any, Optional, Sequence

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
"""Columns read for a rollout, in the order `RolloutRow` indexes them."""


class RolloutRow:
    """A raw `rollouts` row (ROLLOUT_COLUMNS order) with the fields the rules need."""

    __slots__ = ("raw", "_config")

    def __init__(self, raw: tuple[Any, ...]):
        self.raw = raw
        self._config: Optional[RolloutConfig] = None

    @property
    def rollout_id(self) -> str:
        return self.raw[0]

    @property
    def status(self) -> str:
        return self.raw[4]

    @property
    def config(self) -> RolloutConfig:
        if self._config is None:
            self._config = RolloutConfig.model_validate_json(self.raw[5])
        return self._config

    @property
    def num_attempts(self) -> int:
        return self.raw[9]

    @property
    def last_span_seq(self) -> int:
        return self.raw[10]

    @classmethod
    def partial(cls, rollout_id: str, status: str, config_json: str, num_attempts: int) -> "RolloutRow":
        """A row with only the fields status propagation reads (saves a re-select)."""
        return cls((rollout_id, None, None, None, status, config_json, None, None, None, num_attempts, None, None))

    def to_model(self, **override: Any) -> Rollout:
        return Rollout.model_validate(self._fields(override))

    def to_attempted(self, attempt: Attempt, **override: Any) -> AttemptedRollout:
        fields = self._fields(override)
        fields["attempt"] = attempt
        return AttemptedRollout.model_validate(fields)

    def _fields(self, override: dict[str, Any]) -> dict[str, Any]:
        r = self.raw
        fields = {
            "rollout_id": r[0],
            "input": loads_or_none(r[1]),
            "mode": r[2],
            "resources_id": r[3],
            "status": r[4],
            "config": json.loads(r[5]),
            "metadata": loads_or_none(r[6]),
            "start_time": r[7],
            "end_time": r[8],
        }
        fields.update(override)
        return fields


# -- attempts ------------------------------------------------------------------

ATTEMPT_COLUMNS = (
    "rollout_id, attempt_id, sequence_id, status, start_time, end_time, worker_id, "
    "last_heartbeat_time, metadata, session_id, timeout_at, deadline"
)
"""Columns read for an attempt; the last two let a read-only store apply R6 in memory (overdue.py)."""
ATTEMPT_TIMEOUT_AT = 10
ATTEMPT_DEADLINE = 11


def attempt_from_row(r: Sequence[Any]) -> Attempt:
    return Attempt(
        rollout_id=r[0],
        attempt_id=r[1],
        sequence_id=r[2],
        status=r[3],
        start_time=r[4],
        end_time=r[5],
        worker_id=r[6],
        last_heartbeat_time=r[7],
        metadata=loads_or_none(r[8]),
        session_id=r[9],
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


def span_from_row(r: Sequence[Any]) -> Span:
    return Span(
        rollout_id=r[0],
        attempt_id=r[1],
        sequence_id=r[2],
        span_id=r[3],
        trace_id=r[4],
        parent_id=r[5],
        name=r[6],
        start_time=r[7],
        end_time=r[8],
        attributes=json.loads(r[9]),
        prompt_token_ids=unpack_token_ids(r[10]),
        response_token_ids=unpack_token_ids(r[11]),
        response_logprobs=unpack_logprobs(r[12]),
    )
