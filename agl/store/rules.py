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
    takes the id of the latest resources at that moment.

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

R4  Propagation. Only the latest attempt's status propagates to its rollout, each
    time it is set (by `update_attempt`, a span, a deadline, a dead owner):
        preparing -> preparing,  running -> running,  succeeded -> succeeded,
        failed | timeout | unresponsive ->
            `requeuing` if that status is in `config.retry_condition` and
            `attempt.sequence_id < config.max_attempts`, else `failed`.
    `requeuing` puts the rollout at the back of the queue.

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
    enforces this; it runs in the watchdog, inside every dequeue and in every poll
    of `wait_for_rollouts`, and costs one index probe when nothing is due.

R7  Dead owners. An attempt is owned by the store session (one open writable
    `SqliteStore`, i.e. one process) that created it. When that session ends, by
    `close()` or because its process died (noticed when a store opens the file,
    and periodically by the watchdog), its active attempts become `unresponsive`
    and R4 applies: they are retried or failed like any unresponsive attempt.

R8  Explicit rollout updates. `update_rollout(status=s)` sets s as given and leaves
    the attempts alone. `queuing`/`requeuing` put a rollout that was not queued at
    the back of the queue; terminal statuses follow R5; other statuses clear
    `end_time`.

Attempt `end_time` is set when an attempt leaves the active statuses and cleared
if it becomes active again (R3 revival of an `unresponsive` attempt).
"""

from __future__ import annotations

from agl.types import (
    ACTIVE_ATTEMPT_STATUSES,
    QUEUED_ROLLOUT_STATUSES,
    TERMINAL_ROLLOUT_STATUSES,
    AttemptStatus,
    RolloutConfig,
    RolloutStatus,
)

__all__ = [
    "rollout_status_for_attempt",
    "attempt_status_after_heartbeat",
    "expired_status",
    "is_terminal",
    "is_queued",
    "is_active",
]

_DIRECT = {
    AttemptStatus.PREPARING: RolloutStatus.PREPARING,
    AttemptStatus.RUNNING: RolloutStatus.RUNNING,
    AttemptStatus.SUCCEEDED: RolloutStatus.SUCCEEDED,
}


def rollout_status_for_attempt(
    status: AttemptStatus, sequence_id: int, config: RolloutConfig
) -> RolloutStatus:
    """R4: the rollout status implied by the status of its latest attempt."""
    direct = _DIRECT.get(status)
    if direct is not None:
        return direct
    if status in config.retry_condition and sequence_id < config.max_attempts:
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


def is_terminal(status: str) -> bool:
    return status in TERMINAL_ROLLOUT_STATUSES


def is_queued(status: str) -> bool:
    return status in QUEUED_ROLLOUT_STATUSES


def is_active(status: str) -> bool:
    return status in ACTIVE_ATTEMPT_STATUSES
