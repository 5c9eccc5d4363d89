"""Shared data types of the harness.

These are the records that flow between the algorithm, the runners, the model
route and the store. Names and fields follow agent-lightning v0.2 (`Rollout`,
`Attempt`, `AttemptedRollout`, `RolloutConfig`, `ResourcesUpdate`, `Span`) so
that code and intuitions carry over; the additions are the compact token-array
fields on `Span` and the run-state `Checkpoint`.

Statuses are `StrEnum`s: `RolloutStatus.SUCCEEDED == "succeeded"` is true, so
plain strings work everywhere a status is accepted or compared. What the
statuses *mean* and how they move is documented once, in `agl/store/rules.py`.
"""

from __future__ import annotations

import secrets
from enum import StrEnum
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "UNSET",
    "Unset",
    "RolloutMode",
    "RolloutStatus",
    "AttemptStatus",
    "RolloutConfig",
    "Rollout",
    "Attempt",
    "AttemptedRollout",
    "ResourcesUpdate",
    "Span",
    "Checkpoint",
    "TERMINAL_ROLLOUT_STATUSES",
    "QUEUED_ROLLOUT_STATUSES",
    "ACTIVE_ATTEMPT_STATUSES",
    "new_span_id",
]


class Unset:
    """Type of the `UNSET` sentinel: "leave this field unchanged".

    Update methods take `UNSET` as the default for every field so that `None`
    can mean "set to NULL". It is a singleton and survives pickling.
    """

    __slots__ = ()
    _instance: Optional[Unset] = None

    def __new__(cls) -> Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> tuple[Any, ...]:
        return (Unset, ())


UNSET = Unset()

RolloutMode = Literal["train", "val", "test"]


class RolloutStatus(StrEnum):
    QUEUING = "queuing"  # waiting in the queue, never attempted
    PREPARING = "preparing"  # an attempt was handed out; no heartbeat yet
    RUNNING = "running"  # the latest attempt has sent at least one span
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REQUEUING = "requeuing"  # back in the queue after a failed or interrupted attempt


class AttemptStatus(StrEnum):
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"  # ran longer than config.timeout_seconds
    UNRESPONSIVE = "unresponsive"  # no heartbeat for config.unresponsive_seconds, or its harness ended (R7)


TERMINAL_ROLLOUT_STATUSES = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED})
QUEUED_ROLLOUT_STATUSES = frozenset({RolloutStatus.QUEUING, RolloutStatus.REQUEUING})
ACTIVE_ATTEMPT_STATUSES = frozenset({AttemptStatus.PREPARING, AttemptStatus.RUNNING})


class RolloutConfig(BaseModel):
    """Per-rollout execution policy: deadlines and retries."""

    timeout_seconds: Optional[float] = Field(default=None, gt=0)
    """Wall time an attempt may take, counted from the attempt's start. None: no limit."""
    unresponsive_seconds: Optional[float] = Field(default=None, gt=0)
    """Silence allowed since the last heartbeat (or the start, if none). None: no limit."""
    max_attempts: int = Field(default=1, ge=1)
    """Attempts in total, the first included."""
    retry_condition: list[AttemptStatus] = Field(default_factory=list)
    """Attempt outcomes (failed / timeout / unresponsive) that requeue the rollout."""


class Rollout(BaseModel):
    """One task instance to run: the unit the algorithm enqueues and waits for."""

    rollout_id: str
    input: Any
    start_time: float
    """When the rollout was created (enqueued or started)."""
    end_time: Optional[float] = None
    """When it reached a terminal status."""
    mode: Optional[RolloutMode] = None
    resources_id: Optional[str] = None
    status: RolloutStatus = RolloutStatus.QUEUING
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: Optional[dict[str, Any]] = None
    """Free-form; `metadata["step"]` (an int) ties the rollout to a training step."""

    @property
    def step(self) -> Optional[int]:
        """The training step this rollout belongs to (`metadata["step"]`), if any."""
        return None if not self.metadata else self.metadata.get("step")


class Attempt(BaseModel):
    """One execution of a rollout by a worker. Retries create new attempts."""

    rollout_id: str
    attempt_id: str
    sequence_id: int
    """1 for the first attempt of the rollout, n+1 for the next one."""
    start_time: float
    end_time: Optional[float] = None
    status: AttemptStatus = AttemptStatus.PREPARING
    worker_id: Optional[str] = None
    last_heartbeat_time: Optional[float] = None
    metadata: Optional[dict[str, Any]] = None
    session_id: Optional[str] = None
    """The store session (process) that owns the attempt: the one that created it, or
    made it active again (rule R7 in agl/store/rules.py)."""


class AttemptedRollout(Rollout):
    """A rollout together with the attempt just handed out for it."""

    attempt: Attempt

    @model_validator(mode="after")
    def _check_consistency(self) -> AttemptedRollout:
        if self.attempt.rollout_id != self.rollout_id:
            raise ValueError("Inconsistent rollout_id between Rollout and Attempt")
        return self


class ResourcesUpdate(BaseModel):
    """A named, versioned bundle of resources (e.g. the LLM endpoint and policy version)."""

    resources_id: str
    resources: dict[str, Any]
    create_time: Optional[float] = None
    update_time: Optional[float] = None


def new_span_id() -> str:
    """A random 64-bit span id, hex encoded like OpenTelemetry's."""
    return secrets.token_hex(8)


def _to_list(value: Any) -> Any:
    # Accept numpy arrays / torch tensors / array.array without importing them.
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


class Span(BaseModel):
    """One traced operation of an attempt: an LLM call, a tool call, a reward...

    The model route writes one span per LLM call (name "llm.chat" or
    "llm.completion", attributes such as policy_version, request,
    finish_reason) with the token arrays filled in; runners write reward spans
    (name "reward", attributes {"reward": float}). Every span is also a
    heartbeat of its attempt.

    Token arrays are stored compactly (int32 / float32 little-endian BLOBs),
    so ids must fit in int32 and logprobs are kept at float32 precision.
    """

    rollout_id: str
    attempt_id: str
    sequence_id: Optional[int] = None
    """Strictly increasing within a rollout; assigned by the store when None."""
    span_id: str = Field(default_factory=new_span_id)
    trace_id: Optional[str] = None
    parent_id: Optional[str] = None
    name: str
    start_time: Optional[float] = None
    end_time: Optional[float] = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    prompt_token_ids: Optional[list[int]] = None
    response_token_ids: Optional[list[int]] = None
    response_logprobs: Optional[list[float]] = None

    @field_validator("prompt_token_ids", "response_token_ids", "response_logprobs", mode="before")
    @classmethod
    def _arrays_to_lists(cls, value: Any) -> Any:
        return _to_list(value)


class Checkpoint(BaseModel):
    """Everything the trainer needs to resume exactly after `step`.

    `state` is JSON (step bookkeeping, data-loader cursor, Python/numpy RNG
    states, ...); `blobs` holds binary state (LoRA adapter weights, optimizer
    state, torch RNG state, ...). Blobs of old checkpoints are pruned (see
    `SqliteStore(keep_checkpoints=...)`); `blobs_pruned` tells when that
    happened.
    """

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")  # blobs in JSON (a served store)

    step: int
    policy_version: int
    state: dict[str, Any]
    blobs: dict[str, bytes] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    created_time: float
    blobs_pruned: bool = False
