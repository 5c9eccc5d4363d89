"""The status rules of the store. This docstring is the one canonical description;
docs/store.md and the other modules refer to it instead of restating it.

Rollout statuses:  queuing -> preparing -> running -> succeeded | failed | cancelled,
                   plus requeuing (back in the queue for another attempt).
Attempt statuses:  preparing | running | succeeded | failed | timeout | unresponsive.
"Terminal" rollout statuses: succeeded, failed, cancelled.
"Active" attempt statuses:   preparing, running.

R1  Creation. `enqueue_rollout` creates a `queuing` rollout at the back of the FIFO
    queue, with no attempt. `start_rollout` creates the rollout and its attempt 1,
    both `preparing`, outside the queue. A rollout created without `resources_id`
    takes the id of the latest resources at that moment. `enqueue_rollouts(...,
    finished=[...])` records a rollout whose outcome is already known (an eval
    cache's row) in that terminal status, with no attempt and never queued (R5's
    `end_time` set), numbered in order with the rollouts enqueued beside it.

R2  Dequeue. `dequeue_rollout` takes the queued (`queuing` or `requeuing`) rollout
    that entered the queue first, creates attempt n+1 (`preparing`, owned by the
    calling store session) and sets the rollout to `preparing`. Each queue entry
    is handed out once, also across processes sharing the file (BEGIN IMMEDIATE).
    `start_attempt(rollout_id)` creates attempt n+1 for any rollout on demand (an
    explicit retry: it ignores `max_attempts`, takes the rollout out of the queue
    and revives it if it was terminal); the rollout becomes `preparing`.

R3  Heartbeats. Every span is a heartbeat of the attempt it names: the attempt's
    `last_heartbeat_time` becomes now. If that attempt is the rollout's latest and
    is `preparing` or `unresponsive`, it becomes `running`; a latest attempt that
    is (now) `running` propagates by R4, so its rollout is `running` unless
    terminal (this also pulls a rollout that was put back in the queue by hand out
    of the queue). Spans on other attempts, or on finished ones, change no status.
    `update_attempt(last_heartbeat_time=...)` is a heartbeat without a status change.
    An `unresponsive` attempt revived so loses its harness-ended note and passes to
    the session that wrote the span (R7).

R4  Propagation. Only the latest attempt's status propagates to its rollout, each
    time it is set (by `update_attempt`, a span, a deadline, an ended session):
        preparing -> preparing,  running -> running,  succeeded -> succeeded,
        unresponsive because its session ended (R7) -> `requeuing`,
        failed | timeout | unresponsive otherwise ->
            `requeuing` if that status is in `config.retry_condition` and the
            rollout's charged attempts (this one included) < `config.max_attempts`,
            else `failed`.
    An attempt is *charged* unless it carries the harness-ended note of R7: the
    retry budget pays for the agent's tries, not for the harness's crashes. Without
    harness deaths the charged count is `attempt.sequence_id`. `requeuing` puts the
    rollout at the back of the queue.

R5  Terminal is final. Entering succeeded, failed or cancelled sets the rollout's
    `end_time` and wakes `wait_for_rollouts`. Afterwards attempt changes are still
    recorded on the attempt, but no longer propagate: only an explicit
    `update_rollout(status=...)` or `start_attempt` moves a terminal rollout.

R6  Deadlines. An active attempt has two deadlines, copied from its rollout's
    config when created (and refreshed if `update_rollout(config=...)` changes it):
        timeout:       start_time + timeout_seconds
        unresponsive:  (last_heartbeat_time or start_time) + unresponsive_seconds
    Once the earlier one has passed, the attempt becomes `timeout` if its timeout
    deadline has passed, else `unresponsive`; then R4 applies. Attempts expiring
    together are handled in deadline order (ties: creation order), so their
    rollouts re-enter the queue in that order. `check_timeouts()`
    enforces this; it runs in the watchdog, and before every dequeue, every read
    (queries, lookups, each poll of `wait_for_rollouts`) of a writable store, so
    no reader sees an attempt past its deadline as active; it costs one index
    probe when nothing is due. Other writes (spans, `update_attempt`) do not apply
    it first: a live worker's report that beats the watchdog counts. A read-only
    store cannot write: it returns what R6 (then R4) would make of the attempts
    past their deadline at its clock, and leaves the file as it is (overdue.py).

R7  Ended sessions. An attempt is owned by the store session (one open writable
    `SqliteStore`, i.e. one process: the harness; or one client of a store served
    over HTTP, on any host) that created it. When that session ends, by `close()`,
    because its process died (noticed when a store opens the file, and periodically
    by the watchdog) or, a client's, because its heartbeats stopped for its deadline
    (the watchdog, every pass; agl/store/sessions.py), its active attempts become
    `unresponsive`, in creation order, with the harness-ended note merged into
    their metadata: `{"harness_ended": "closed" | "dead", "error": "<why>"}`.
    Such an attempt is not charged (R4): the agent did not fail, so its rollout
    goes back to the queue (`requeuing`) whatever `retry_condition` and
    `max_attempts` say, unless it is terminal (R5) or the attempt is not its
    latest. A `kill -9` of the harness therefore costs the rollouts nothing. The
    note describes how the attempt ended; any later status change of the attempt
    (a revival by a span, R3, or `update_attempt(status=...)`) drops it, and the
    attempt counts again. An attempt made active again by a session (R3, or
    `update_attempt` to `preparing`/`running`) is owned by that session from then
    on, so that R7 still covers it when its first owner is gone.

R8  Explicit rollout updates. `update_rollout(status=s)` sets s as given and leaves
    the attempts alone. `queuing`/`requeuing` put a rollout that was not queued at
    the back of the queue; terminal statuses follow R5; other statuses clear
    `end_time`.

Attempt `end_time` is set when an attempt leaves the active statuses and cleared
if it becomes active again (R3 revival of an `unresponsive` attempt).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Optional

from agl.types import (
    ACTIVE_ATTEMPT_STATUSES,
    QUEUED_ROLLOUT_STATUSES,
    TERMINAL_ROLLOUT_STATUSES,
    Attempt,
    AttemptStatus,
    RolloutConfig,
    RolloutStatus,
)

__all__ = [
    "HARNESS_ENDED",
    "rollout_status_for_attempt",
    "attempt_status_after_heartbeat",
    "expired_status",
    "harness_ended_note",
    "is_harness_ended",
    "charged_attempt_number",
    "is_terminal",
    "is_queued",
    "is_active",
]

HARNESS_ENDED = "harness_ended"
"""Metadata key of R7's note. SQL reads it as `json_extract(metadata, '$.harness_ended')`
(txn.py, the views in schema.sql, agl/report/run_report.py)."""

SessionEnd = Literal["closed", "dead"]

_DIRECT = {
    AttemptStatus.PREPARING: RolloutStatus.PREPARING,
    AttemptStatus.RUNNING: RolloutStatus.RUNNING,
    AttemptStatus.SUCCEEDED: RolloutStatus.SUCCEEDED,
}


def rollout_status_for_attempt(
    status: AttemptStatus, charged_attempts: int, config: RolloutConfig, harness_ended: bool = False
) -> RolloutStatus:
    """R4: the rollout status implied by the status of its latest attempt.

    `charged_attempts`: the rollout's attempts without the harness-ended note, this
    one included; `harness_ended`: this attempt just ended with its session (R7)."""
    direct = _DIRECT.get(status)
    if direct is not None:
        return direct
    if harness_ended:
        return RolloutStatus.REQUEUING
    if status in config.retry_condition and charged_attempts < config.max_attempts:
        return RolloutStatus.REQUEUING
    return RolloutStatus.FAILED


def attempt_status_after_heartbeat(status: AttemptStatus, is_latest: bool) -> AttemptStatus:
    """R3: the status of an attempt after one of its spans arrives."""
    if is_latest and status in (AttemptStatus.PREPARING, AttemptStatus.UNRESPONSIVE):
        return AttemptStatus.RUNNING
    return status


def expired_status(timeout_at: float | None, now: float) -> AttemptStatus:
    """R6: which status an attempt past its deadline gets."""
    if timeout_at is not None and timeout_at <= now:
        return AttemptStatus.TIMEOUT
    return AttemptStatus.UNRESPONSIVE


def harness_ended_note(how: SessionEnd, pid: Optional[int]) -> dict[str, str]:
    """R7: what is merged into the metadata of an attempt whose session ended."""
    process = "the harness process" + ("" if pid is None else f" (pid {pid})")
    why = "died" if how == "dead" else "closed its store"
    return {HARNESS_ENDED: how, "error": f"{process} {why} while this attempt ran"}


def is_harness_ended(attempt: Attempt) -> bool:
    """Whether the attempt carries R7's note, i.e. is not charged (R4)."""
    return bool(attempt.metadata) and attempt.metadata.get(HARNESS_ENDED) is not None  # type: ignore[union-attr]


def charged_attempt_number(attempts: Iterable[Attempt], attempt: Attempt) -> int:
    """The number of `attempt` among the agent's tries of its rollout: 1 + the charged
    attempts before it in `attempts` (all attempts of the rollout, e.g. from
    `store.query_attempts`). 1 for the first try; a rerun after a harness death gets
    the number of the try it replaces, so anything derived from it (the model route's
    sampling seeds) repeats what the interrupted try would have done. For the latest
    attempt, while charged, it equals R4's count of charged attempts."""
    return 1 + sum(1 for a in attempts if a.sequence_id < attempt.sequence_id and not is_harness_ended(a))


def is_terminal(status: str) -> bool:
    return status in TERMINAL_ROLLOUT_STATUSES


def is_queued(status: str) -> bool:
    return status in QUEUED_ROLLOUT_STATUSES


def is_active(status: str) -> bool:
    return status in ACTIVE_ATTEMPT_STATUSES
