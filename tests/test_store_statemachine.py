"""Property test: SqliteStore against a small reference model of the status rules.

The model below is written from the rules in agl/store/rules.py without using
that module: plain dicts and lists, a FIFO list for the queue. Hypothesis drives
both with random sequences of enqueue / start / dequeue / span / finish /
explicit updates / clock advances + timeout checks, and with a second store on
the same file acting as a runner process that dequeues and then ends with
attempts in flight (closed, or its process found dead). After every step the
whole store must match the model — as read by the writer (which applies due
deadlines before reading) and by a read-only reader (which shows them applied
without writing) — no rollout may be lost or handed out twice, and an ended
runner's attempts must never use up a retry.

Depth: ``make test`` runs 20 random programs of up to 40 steps (a few seconds); ``AGL_LONG=1`` runs
the full 120 (about a minute on a 2-core machine), e.g. after changing agl/store/.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from store_helpers import FakeClock, abandon, check_invariants, client_of, derive_rollout_status, pretend_dead

from agl.store import SqliteStore
from agl.types import RolloutConfig, Span

TERMINAL = {"succeeded", "failed", "cancelled"}
QUEUED = {"queuing", "requeuing"}
ACTIVE = {"preparing", "running"}

CONFIGS = [
    RolloutConfig(),
    RolloutConfig(
        max_attempts=3,
        retry_condition=["failed", "timeout", "unresponsive"],
        timeout_seconds=10,
        unresponsive_seconds=3,
    ),
    RolloutConfig(max_attempts=2, retry_condition=["unresponsive"], unresponsive_seconds=4),
    RolloutConfig(timeout_seconds=5),
]


@dataclass
class MAttempt:
    attempt_id: str
    seq: int
    start: float
    created: int  # global creation order
    owner: str  # the session that created it
    status: str = "preparing"
    heartbeat: Optional[float] = None
    harness_ended: bool = False  # cut short by its session's end (not charged)


@dataclass
class MRollout:
    rollout_id: str
    config: RolloutConfig
    status: str
    attempts: list[MAttempt] = field(default_factory=list)

    def charged(self) -> int:
        return sum(1 for a in self.attempts if not a.harness_ended)


class Model:
    """The reference: the status rules, restated as simply as possible."""

    def __init__(self) -> None:
        self.rollouts: dict[str, MRollout] = {}
        self.queue: list[str] = []
        self.created = 0

    def attempt(self, attempt_id: str, seq: int, now: float, owner: str) -> MAttempt:
        self.created += 1
        return MAttempt(attempt_id, seq, now, self.created, owner)

    def set_status(self, r: MRollout, new: str) -> None:
        if new == r.status:
            return
        if new in QUEUED and r.status not in QUEUED:
            self.queue.append(r.rollout_id)
        if new not in QUEUED and r.status in QUEUED:
            self.queue.remove(r.rollout_id)
        r.status = new

    def propagate(self, r: MRollout, a: MAttempt) -> None:
        if a is r.attempts[-1] and r.status not in TERMINAL:
            self.set_status(r, derive_rollout_status(a.status, r.charged(), r.config.model_dump(), a.harness_ended))

    def set_attempt_status(self, r: MRollout, a: MAttempt, status: str, session: Optional[str] = None) -> None:
        if status in ACTIVE and a.status not in ACTIVE:
            a.owner = session  # whoever makes it active again owns it
        a.status = status
        a.harness_ended = False  # the note says how it ended; it has not, or not that way
        self.propagate(r, a)

    def new_attempt(self, r: MRollout, attempt_id: str, now: float, owner: str) -> None:
        r.attempts.append(self.attempt(attempt_id, len(r.attempts) + 1, now, owner))
        self.set_status(r, "preparing")

    def span(self, r: MRollout, a: MAttempt, now: float, session: str) -> None:
        a.heartbeat = now
        if a is r.attempts[-1]:
            if a.status in ("preparing", "unresponsive"):
                self.set_attempt_status(r, a, "running", session)
            elif a.status == "running":
                self.propagate(r, a)

    def end_session(self, owner: str) -> dict[str, str]:
        """R7: the session's active attempts, in creation order, end uncharged."""
        ended = sorted(
            (
                (a.created, r, a)
                for r in self.rollouts.values()
                for a in r.attempts
                if a.owner == owner and a.status in ACTIVE
            ),
            key=lambda t: t[0],
        )
        for _, r, a in ended:
            a.status, a.harness_ended = "unresponsive", True
            self.propagate(r, a)
        return {a.attempt_id: a.status for _, _, a in ended}

    def expire(self, now: float) -> None:
        """Expire due attempts in deadline order (ties: creation order)."""
        due = []
        for r in self.rollouts.values():
            cfg = r.config
            for a in r.attempts:
                if a.status not in ACTIVE:
                    continue
                timeout_at = None if cfg.timeout_seconds is None else a.start + cfg.timeout_seconds
                silent_at = (
                    None
                    if cfg.unresponsive_seconds is None
                    else (a.heartbeat if a.heartbeat is not None else a.start) + cfg.unresponsive_seconds
                )
                limits = [t for t in (timeout_at, silent_at) if t is not None]
                if limits and min(limits) <= now:
                    due.append((min(limits), a.created, r, a, timeout_at))
        for _, _, r, a, timeout_at in sorted(due, key=lambda d: d[:2]):
            self.set_attempt_status(r, a, "timeout" if timeout_at is not None and timeout_at <= now else "unresponsive")


class StoreMachine(RuleBasedStateMachine):
    """The local store; `ClientStoreMachine` below: the same through clients of it served over HTTP."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="agl-store-sm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self.path = self.dir / "store.sqlite"
        self.clock = FakeClock()
        self.loop = asyncio.Runner()
        self.local = SqliteStore(self.path, clock=self.clock, watchdog_interval=None)
        self.store = self.connect()
        self.reader = SqliteStore.open_readonly(self.path, clock=self.clock)
        self.runner = None  # another harness process on the same file (a client: another host's)
        self.model = Model()

    def connect(self):
        """A store for a harness process: the one process's, or another one on the file."""
        return (
            self.local
            if not hasattr(self, "store")
            else SqliteStore(self.path, clock=self.clock, watchdog_interval=None)
        )

    def run(self, coro):
        return self.loop.run(coro)

    def teardown(self) -> None:
        try:
            for store in (self.runner, self.reader, self.store, self.local):
                if store is not None:
                    self.run(store.close())
        finally:
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def pick(self, index: int) -> MRollout:
        ids = list(self.model.rollouts)
        return self.model.rollouts[ids[index % len(ids)]]

    def has_attempts(self) -> bool:
        return any(r.attempts for r in self.model.rollouts.values())

    def pick_attempted(self, index: int) -> MRollout:
        attempted = [r for r in self.model.rollouts.values() if r.attempts]
        return attempted[index % len(attempted)]

    # -- rules ------------------------------------------------------------------

    @rule(config=st.integers(0, len(CONFIGS) - 1))
    def enqueue(self, config: int) -> None:
        r = self.run(self.store.enqueue_rollout("x", config=CONFIGS[config]))
        assert r.status == "queuing"
        self.model.rollouts[r.rollout_id] = MRollout(r.rollout_id, CONFIGS[config], "queuing")
        self.model.queue.append(r.rollout_id)

    def _start_rollout(self, store: SqliteStore, config: int) -> None:
        r = self.run(store.start_rollout("x", config=CONFIGS[config]))
        m = MRollout(r.rollout_id, CONFIGS[config], "preparing")
        m.attempts.append(self.model.attempt(r.attempt.attempt_id, 1, self.clock.now, store.session_id))
        self.model.rollouts[r.rollout_id] = m

    def _dequeue(self, store: SqliteStore) -> None:
        """Each dequeue must hand out exactly the model's queue head: no entry is
        skipped (lost) or handed out twice."""
        self.model.expire(self.clock.now)  # dequeue applies due deadlines first
        got = self.run(store.dequeue_rollout(worker_id="w"))
        if not self.model.queue:
            assert got is None
            return
        expected = self.model.rollouts[self.model.queue[0]]
        assert got is not None and got.rollout_id == expected.rollout_id
        assert got.attempt.sequence_id == len(expected.attempts) + 1
        self.model.new_attempt(expected, got.attempt.attempt_id, self.clock.now, store.session_id)

    @rule(config=st.integers(0, len(CONFIGS) - 1))
    def start_rollout(self, config: int) -> None:
        self._start_rollout(self.store, config)

    @rule()
    def dequeue(self) -> None:
        self._dequeue(self.store)

    @rule(start=st.booleans(), config=st.integers(0, len(CONFIGS) - 1))
    def runner_takes_work(self, start: bool, config: int) -> None:
        if self.runner is None:
            self.runner = self.connect()
        self._start_rollout(self.runner, config) if start else self._dequeue(self.runner)

    @precondition(lambda self: self.runner is not None)
    @rule(dead=st.booleans())
    def runner_ends(self, dead: bool) -> None:
        """The runner harness goes away with attempts in flight: closed, or killed."""
        runner, self.runner = self.runner, None
        latest_active = [
            r
            for r in self.model.rollouts.values()
            if r.attempts
            and r.status not in TERMINAL
            and r.attempts[-1].owner == runner.session_id
            and r.attempts[-1].status in ACTIVE
        ]
        expected = self.model.end_session(runner.session_id)
        if dead:
            abandon(runner)  # as kill -9 leaves it: the session stays open in the file
            pretend_dead(self.path, runner.session_id)  # its process is gone, or its heartbeats stopped
            changed = self.run(self.store.reap_dead_sessions())
            assert [(a.attempt_id, a.status) for a in changed] == list(expected.items())
            assert all(a.metadata["harness_ended"] == "dead" for a in changed)
        else:
            self.run(runner.close())
        # Not charged: whatever max_attempts says, the rollouts go back to the queue.
        for r in latest_active:
            assert self.run(self.store.get_rollout_by_id(r.rollout_id)).status == "requeuing"

    @precondition(lambda self: self.model.rollouts)
    @rule(index=st.integers(0, 1000))
    def start_attempt(self, index: int) -> None:
        r = self.pick(index)
        got = self.run(self.store.start_attempt(r.rollout_id))
        self.model.new_attempt(r, got.attempt.attempt_id, self.clock.now, self.store.session_id)

    @precondition(lambda self: self.has_attempts())
    @rule(index=st.integers(0, 1000), older=st.booleans())
    def add_span(self, index: int, older: bool) -> None:
        r = self.pick_attempted(index)
        a = r.attempts[0] if older else r.attempts[-1]
        self.run(
            self.store.add_span(
                Span(
                    rollout_id=r.rollout_id,
                    attempt_id=a.attempt_id,
                    name="llm.chat",
                    prompt_token_ids=[1, 2],
                    response_logprobs=[-0.5],
                )
            )
        )
        self.model.span(r, a, self.clock.now, self.store.session_id)

    @precondition(lambda self: self.has_attempts())
    @rule(
        index=st.integers(0, 1000),
        older=st.booleans(),
        status=st.sampled_from(["succeeded", "failed", "timeout", "unresponsive", "running"]),
    )
    def update_attempt(self, index: int, older: bool, status: str) -> None:
        r = self.pick_attempted(index)
        a = r.attempts[0] if older else r.attempts[-1]
        target = a.attempt_id if older else "latest"
        got = self.run(self.store.update_attempt(r.rollout_id, target, status=status))
        assert got.attempt_id == a.attempt_id and got.status == status
        self.model.set_attempt_status(r, a, status, self.store.session_id)

    @precondition(lambda self: self.model.rollouts)
    @rule(index=st.integers(0, 1000), status=st.sampled_from(["cancelled", "requeuing", "queuing", "failed"]))
    def update_rollout_status(self, index: int, status: str) -> None:
        r = self.pick(index)
        self.run(self.store.update_rollout(r.rollout_id, status=status))
        self.model.set_status(r, status)

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 3.0, 4.0, 6.0, 11.0]))
    def advance_and_check(self, seconds: float) -> None:
        self.clock.advance(seconds)
        changed = self.run(self.store.check_timeouts())
        before = {a.attempt_id: a.status for r in self.model.rollouts.values() for a in r.attempts}
        self.model.expire(self.clock.now)
        after = {a.attempt_id: a.status for r in self.model.rollouts.values() for a in r.attempts}
        expected = {aid: s for aid, s in after.items() if before[aid] != s}
        assert {a.attempt_id: a.status for a in changed} == expected

    @rule(seconds=st.sampled_from([1.0, 4.0, 11.0]))
    def time_passes(self, seconds: float) -> None:
        """No check_timeouts: the next reads must apply (or, read-only, show) the deadlines."""
        self.clock.advance(seconds)

    # -- invariants -------------------------------------------------------------

    def matches_model(self, store: SqliteStore) -> None:
        rollouts = self.run(store.query_rollouts())
        assert [r.rollout_id for r in rollouts] == list(self.model.rollouts)
        for r in rollouts:
            m = self.model.rollouts[r.rollout_id]
            assert r.status == m.status, (r.rollout_id, r.status, m.status)
            assert (r.end_time is not None) == (m.status in TERMINAL)
            attempts = self.run(store.query_attempts(r.rollout_id))
            assert [
                (a.attempt_id, a.status, a.session_id, "harness_ended" in (a.metadata or {})) for a in attempts
            ] == [(a.attempt_id, a.status, a.owner, a.harness_ended) for a in m.attempts]
        queued = self.run(store.query_rollouts(status=["queuing", "requeuing"]))
        assert sorted(r.rollout_id for r in queued) == sorted(self.model.queue)

    @invariant()
    def store_matches_model(self) -> None:
        # Reads apply due deadlines: the read-only reader first (it only shows them, so
        # it sees the file unexpired), then the writer (which expires them for real).
        self.model.expire(self.clock.now)
        self.matches_model(self.reader)
        self.matches_model(self.store)

    @invariant()
    def file_is_consistent(self) -> None:
        # Structural checks only: explicit updates and late reports on terminal
        # rollouts (R5, R8) are legal here; the model comparison covers statuses.
        if len(self.model.rollouts) % 5 == 0:  # the full check is slower; sample it
            assert check_invariants(self.path, explicit_updates=True) == []


class ClientStoreMachine(StoreMachine):
    """The same rules through `StoreClient`s of the store served over HTTP (in this process, on the same fake
    clock): the writer and the runner are two clients, each a session of its own; a runner that dies stops
    heartbeating (its deadline passes), one that closes ends its session."""

    def connect(self):
        client = client_of(self.local)
        self.run(client.open())
        return client


SETTINGS = settings(
    max_examples=120 if os.environ.get("AGL_LONG") == "1" else 20,  # see the module docstring
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
StoreMachine.TestCase.settings = SETTINGS
ClientStoreMachine.TestCase.settings = SETTINGS
TestStoreStateMachine = StoreMachine.TestCase
TestClientStoreStateMachine = ClientStoreMachine.TestCase
