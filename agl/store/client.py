"""`StoreClient`: `SqliteStore`'s API over HTTP, for a store served by agl/store/server.py; `SyncStoreClient`:
the same, blocking, as agent-lightning's examples call it.

    store = agl.StoreClient("http://127.0.0.1:4747", api_key=...)     # async: await store.enqueue_rollout(...)
    store = agl.SyncStoreClient("http://127.0.0.1:4747", api_key=...) # sync:  store.enqueue_rollout(...)

The methods are `SqliteStore`'s own (api.METHODS), with their signatures, docstrings, return types and
errors: a `ValueError` for an unknown id is a `ValueError` here too, a `Rollout` comes back a `Rollout`.
The store's docstring is the contract; this module only carries it.

A client is a store session of its own (rules.py R7), opened on its first call (or `open()`, `async with`)
and kept alive by heartbeats, a request each `heartbeat_interval` from a thread of its own (so a process
whose event loop is busy, in a job's update or under an agent that blocks it, is alive all the same).
`session_id` names it; the attempts it dequeues are its own. `close()` ends it: its attempts in flight go
back to the queue uncharged, as a local store's close does. If its heartbeats stop (the process
died, or the network was cut) for the server's `store.session_timeout`, the server ends it as dead, with
the same effect.

A client knows when what it reported may not count, and says so, so its user can act (a runner process
gives its session up and joins again, agl/agents/attach.py; a job stops and resumes exactly):

  * `broken` (a reason, or None): a request whose outcome is unknown (the connection failed after it was
    sent), or a write refused because the session had ended (`SessionEnded`). Every later call raises
    `StoreUnreachable`; make a new client.
  * `disconnects`: heartbeats that could not reach the server. The session may have outlived the cut, but
    what an agent made of it (its calls to the route went the same way) says nothing about the agent.

Requests that could not connect (nothing was sent) are tried again for `connect_retry_s`, so a server that
restarts is waited for; so is a `wait_for_rollouts` request whose connection failed after it was sent (it only
reads: `REPEATABLE`). `wait_for_rollouts` waits in requests of at most 30 s each (api.MAX_WAIT_S).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import httpx

from agl.errors import ConfigError, DiskFull
from agl.store.api import KEEPALIVE_S, MAX_WAIT_S, METHODS, SESSION_HEADER, Method, methods
from agl.store.db import ReadOnlyStoreError, StoreDamaged
from agl.store.sessions import SessionEnded
from agl.store.store import SqliteStore
from agl.types import Rollout

log = logging.getLogger(__name__)

__all__ = ["StoreClient", "SyncStoreClient", "StoreUnreachable", "SessionEnded"]


class StoreUnreachable(ConnectionError):
    """The store server could not be reached, or a request's outcome is unknown (the connection failed
    after it was sent), or the client is broken by an earlier such failure (`StoreClient.broken`)."""


# the classes a server's error names (server.STATUS), raised again here; anything else is a RuntimeError
ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        KeyError,
        RuntimeError,
        PermissionError,
        AttributeError,
        SessionEnded,
        ReadOnlyStoreError,
        DiskFull,
        StoreDamaged,
        ConfigError,
    )
}
LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S)
# nothing was sent: safe to try again (a retry of a request that reached the server could run it twice)
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# methods that only read: one whose connection failed after it was sent is sent again as if it had not been (a
# server that stops or restarts resets the long polls of `wait_for_rollouts` in flight)
REPEATABLE = frozenset({"wait_for_rollouts"})


def raise_error(response: httpx.Response) -> None:
    """The exception a server's error reply names (server.py's shape), raised again."""
    try:
        error = response.json()["error"]
        kind, message = error["type"], error["message"]
    except (ValueError, KeyError, TypeError):
        kind, message = "RuntimeError", f"store server answered {response.status_code}: {response.text[:500]}"
    cls = ERRORS.get(kind, RuntimeError)
    exception = cls.__new__(cls)  # DiskFull, StoreDamaged: their own constructors format a message we already have
    Exception.__init__(exception, message)
    raise exception


class _Wire:
    """What both clients share: the URL, the key, the session, and how a call becomes a request and its
    reply a result or an error."""

    def __init__(self, url: str, api_key: Optional[str], heartbeat_interval: Optional[float], connect_retry_s: float):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.heartbeat_interval = heartbeat_interval  # None: a fraction of the server's session timeout
        self.connect_retry_s = connect_retry_s
        self.session_id: Optional[str] = None
        self.heartbeat_seconds: Optional[float] = None
        self.broken: Optional[str] = None
        self.disconnects = 0
        self.closed = False

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        if self.session_id is not None:
            headers[SESSION_HEADER] = self.session_id
        return headers

    def check_usable(self) -> None:
        if self.closed:
            raise RuntimeError(f"store client of {self.url} is closed")
        if self.broken is not None:
            raise StoreUnreachable(f"store client of {self.url} is broken: {self.broken}; make a new one")

    def lost(self, reason: str) -> StoreUnreachable:
        self.broken = self.broken or reason
        return StoreUnreachable(reason)

    def result(self, method: Method, response: httpx.Response) -> Any:
        if response.status_code != 200:
            if response.status_code == 409:
                self.broken = self.broken or f"its store session {self.session_id} has ended"
            raise_error(response)
        return method.decode_result(response.content)

    def session_request(self) -> dict:
        return {"hostname": socket.gethostname(), "pid": os.getpid()}

    def opened(self, response: httpx.Response) -> None:
        if response.status_code != 200:
            raise_error(response)
        reply = response.json()
        self.session_id, self.heartbeat_seconds = reply["session_id"], reply["heartbeat_seconds"]

    def interval(self) -> float:
        """Seconds between heartbeats: a quarter of the deadline, at most 1 s (so a cut is noticed soon)."""
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return min(self.heartbeat_seconds / 4, 1.0)

    def read_timeout(self, method: Method) -> Optional[float]:
        """A reply's deadline: a wait's is its longest wait and a minute more; None: the default (300 s)."""
        return MAX_WAIT_S + 60.0 if method.name == "wait_for_rollouts" else None


class _Heartbeats:
    """A session's heartbeats from a thread of their own, with a connection of their own: a process whose
    event loop is busy (a job's update, an agent that blocks it) is alive all the same. `on_ended` is called
    (from the thread) when the server says the session has ended."""

    def __init__(self, wire: _Wire, on_ended: Callable[[str], None], transport: Optional[httpx.BaseTransport] = None):
        self.wire, self.on_ended = wire, on_ended
        self.http = httpx.Client(base_url=wire.url, transport=transport, timeout=10.0)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="agl-store-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        wire = self.wire
        try:
            while not self.stopped.wait(wire.interval()):
                try:
                    response = self.http.post(f"/v1/sessions/{wire.session_id}/heartbeat", headers=wire.headers())
                except httpx.TransportError as error:
                    wire.disconnects += 1
                    log.warning("store client of %s: a heartbeat could not reach the store (%r)", wire.url, error)
                    continue
                if response.status_code == 409:
                    self.on_ended(f"its store session {wire.session_id} was ended by the store (no heartbeat in time)")
                    return
        finally:
            self.http.close()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def _timeout(read: Optional[float]) -> httpx.Timeout:
    return httpx.Timeout(connect=10.0, read=read if read is not None else 300.0, write=300.0, pool=60.0)


class StoreClient:
    """`SqliteStore`'s API on a store server (see the module docstring); every method is `async`.

    Args:
        url: the server, e.g. ``http://127.0.0.1:4747`` (what `python harness.py algo=store` prints).
        api_key: the server's `store.api_key` (sent as ``Authorization: Bearer <key>``).
        heartbeat_interval: seconds between the session's heartbeats (None: a quarter of the server's
            `session_timeout`, at most 1 s).
        connect_retry_s: how long a request that cannot connect is tried again.
        transport: an httpx transport (tests: ``httpx.ASGITransport(app=StoreServer(...).app)``).
        on_broken: called once with the reason when the client breaks (see the module docstring).
    """

    def __init__(
        self,
        url: str,
        api_key: Optional[str] = None,
        *,
        heartbeat_interval: Optional[float] = None,
        connect_retry_s: float = 30.0,
        transport: Optional[httpx.AsyncBaseTransport] = None,
        on_broken: Optional[Callable[[str], None]] = None,
    ):
        self._wire = _Wire(url, api_key, heartbeat_interval, connect_retry_s)
        self._http = httpx.AsyncClient(
            base_url=self._wire.url, transport=transport, timeout=_timeout(None), limits=LIMITS
        )
        self._on_broken = on_broken
        self._open_lock: Optional[asyncio.Lock] = None
        self._in_process = transport is not None  # an ASGI transport (tests): heartbeats on the loop, as a task
        self._heartbeat: Optional[asyncio.Task] = None
        self._heartbeats: Optional[_Heartbeats] = None

    @property
    def url(self) -> str:
        return self._wire.url

    @property
    def path(self) -> str:
        """Where the store is, for messages (a `SqliteStore`'s is its file): the server's URL."""
        return self._wire.url

    @property
    def session_id(self) -> Optional[str]:
        """This client's store session (None until it is opened)."""
        return self._wire.session_id

    @property
    def broken(self) -> Optional[str]:
        return self._wire.broken

    @property
    def disconnects(self) -> int:
        return self._wire.disconnects

    # -- lifecycle ---------------------------------------------------------------

    async def open(self) -> StoreClient:
        """Open this client's store session now (the first call does it otherwise); idempotent."""
        if self._wire.session_id is not None:
            return self
        self._wire.check_usable()
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self._wire.session_id is None:
                response = await self._send("POST", "/v1/sessions", json=self._wire.session_request())
                self._wire.opened(response)
                if self._in_process:
                    self._heartbeat = asyncio.create_task(self._beat_on_loop(), name="agl-store-heartbeat")
                else:
                    loop = asyncio.get_running_loop()
                    self._heartbeats = _Heartbeats(self._wire, lambda why: loop.call_soon_threadsafe(self._break, why))
        return self

    async def close(self) -> None:
        """End this client's session (its attempts in flight go back to the queue uncharged, R7) and close
        its connections. Idempotent; a server that cannot be reached leaves the session to its deadline."""
        if self._wire.closed:
            return
        self._wire.closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._heartbeats is not None:
            await asyncio.to_thread(self._heartbeats.stop)
        if self._wire.session_id is not None:
            with contextlib.suppress(httpx.HTTPError):
                await self._http.delete(
                    f"/v1/sessions/{self._wire.session_id}", headers=self._wire.headers(), timeout=10.0
                )
        await self._http.aclose()

    async def __aenter__(self) -> StoreClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests ----------------------------------------------------------------

    def _break(self, reason: str) -> StoreUnreachable:
        first = self._wire.broken is None
        error = self._wire.lost(reason)
        if first:
            log.warning("store client of %s: %s", self.url, reason)
            if self._on_broken is not None:
                self._on_broken(reason)
        return error

    async def _send(self, verb: str, path: str, repeatable: bool = False, **kwargs: Any) -> httpx.Response:
        """One request; tried again while it cannot connect (for `connect_retry_s`), and a `repeatable` one also
        when its connection failed after it was sent."""
        deadline = time.monotonic() + self._wire.connect_retry_s
        pause = 0.05
        while True:
            try:
                return await self._http.request(verb, path, headers=self._wire.headers(), **kwargs)
            except httpx.TransportError as error:
                if not (repeatable or isinstance(error, NOT_SENT)):
                    raise self._break(f"a request to the store at {self.url} failed: {error!r}") from None
                if time.monotonic() >= deadline:
                    raise self._break(f"cannot reach the store at {self.url}: {error!r}") from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)

    async def _call(self, method: Method, arguments: dict[str, Any]) -> Any:
        self._wire.check_usable()
        if self._wire.session_id is None:
            await self.open()
        body = method.encode_arguments(arguments)
        response = await self._send(
            "POST",
            f"/v1/store/{method.name}",
            repeatable=method.name in REPEATABLE,
            content=body,
            timeout=_timeout(self._wire.read_timeout(method)),
        )
        try:
            return self._wire.result(method, response)
        except SessionEnded:
            self._break(f"its store session {self.session_id} has ended")
            raise

    async def _beat_on_loop(self) -> None:
        """Heartbeats as a task of the loop, for a client on an in-process transport (tests)."""
        while True:
            await asyncio.sleep(self._wire.interval())
            try:
                response = await self._http.post(
                    f"/v1/sessions/{self._wire.session_id}/heartbeat", headers=self._wire.headers(), timeout=10.0
                )
            except httpx.TransportError:
                self._wire.disconnects += 1
                continue
            if response.status_code == 409:
                self._break(f"its store session {self.session_id} was ended by the store (no heartbeat in time)")
                return

    async def _wait(self, rollout_ids: Sequence[str], timeout: Optional[float]) -> list[Rollout]:
        """`wait_for_rollouts`, in requests of at most `MAX_WAIT_S` each."""
        waiting = _Waiting(rollout_ids, timeout)
        while not waiting.over():
            waiting.add(await self._call(methods()["wait_for_rollouts"], waiting.request()))
        return waiting.result()


class SyncStoreClient:
    """`StoreClient`, blocking (agent-lightning's examples call the store so): the same methods without
    ``await``, heartbeats from a daemon thread. Arguments as `StoreClient`'s (an httpx `BaseTransport`)."""

    def __init__(
        self,
        url: str,
        api_key: Optional[str] = None,
        *,
        heartbeat_interval: Optional[float] = None,
        connect_retry_s: float = 30.0,
        transport: Optional[httpx.BaseTransport] = None,
    ):
        self._wire = _Wire(url, api_key, heartbeat_interval, connect_retry_s)
        self._http = httpx.Client(base_url=self._wire.url, transport=transport, timeout=_timeout(None), limits=LIMITS)
        self._transport = transport
        self._lock = threading.Lock()
        self._heartbeats: Optional[_Heartbeats] = None

    url = StoreClient.url
    path = StoreClient.path
    session_id = StoreClient.session_id
    broken = StoreClient.broken
    disconnects = StoreClient.disconnects

    def open(self) -> SyncStoreClient:
        """Open this client's store session now (the first call does it otherwise); idempotent."""
        with self._lock:
            if self._wire.session_id is None:
                self._wire.check_usable()
                self._wire.opened(self._send("POST", "/v1/sessions", json=self._wire.session_request()))
                self._heartbeats = _Heartbeats(self._wire, self._wire.lost, self._transport)
        return self

    def close(self) -> None:
        """As `StoreClient.close`."""
        if self._wire.closed:
            return
        self._wire.closed = True
        if self._heartbeats is not None:
            self._heartbeats.stop()
        if self._wire.session_id is not None:
            with contextlib.suppress(httpx.HTTPError):
                self._http.delete(f"/v1/sessions/{self._wire.session_id}", headers=self._wire.headers(), timeout=10.0)
        self._http.close()

    def __enter__(self) -> SyncStoreClient:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, verb: str, path: str, repeatable: bool = False, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + self._wire.connect_retry_s
        pause = 0.05
        while True:
            try:
                return self._http.request(verb, path, headers=self._wire.headers(), **kwargs)
            except httpx.TransportError as error:
                if not (repeatable or isinstance(error, NOT_SENT)):
                    raise self._wire.lost(f"a request to the store at {self.url} failed: {error!r}") from None
                if time.monotonic() >= deadline:
                    raise self._wire.lost(f"cannot reach the store at {self.url}: {error!r}") from None
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    def _call(self, method: Method, arguments: dict[str, Any]) -> Any:
        self._wire.check_usable()
        if self._wire.session_id is None:
            self.open()
        response = self._send(
            "POST",
            f"/v1/store/{method.name}",
            repeatable=method.name in REPEATABLE,
            content=method.encode_arguments(arguments),
            timeout=_timeout(self._wire.read_timeout(method)),
        )
        return self._wire.result(method, response)

    def _wait(self, rollout_ids: Sequence[str], timeout: Optional[float]) -> list[Rollout]:
        """`wait_for_rollouts`, in requests of at most `MAX_WAIT_S` each."""
        waiting = _Waiting(rollout_ids, timeout)
        while not waiting.over():
            waiting.add(self._call(methods()["wait_for_rollouts"], waiting.request()))
        return waiting.result()


class _Waiting:
    """One `wait_for_rollouts` made of requests of at most `MAX_WAIT_S`: what each asks, and when it is over."""

    def __init__(self, rollout_ids: Sequence[str], timeout: Optional[float]):
        self.asked = list(rollout_ids)
        self.wanted = list(dict.fromkeys(self.asked))
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.done: dict[str, Rollout] = {}
        self.asked_once = False

    def request(self) -> dict[str, Any]:
        self.asked_once = True
        left = MAX_WAIT_S if self.deadline is None else max(0.0, min(self.deadline - time.monotonic(), MAX_WAIT_S))
        return {"rollout_ids": [rid for rid in self.wanted if rid not in self.done], "timeout": left}

    def add(self, finished: list[Rollout]) -> None:
        self.done.update((r.rollout_id, r) for r in finished)

    def over(self) -> bool:
        if not self.asked_once:
            return False
        return len(self.done) == len(self.wanted) or (self.deadline is not None and time.monotonic() >= self.deadline)

    def result(self) -> list[Rollout]:
        return [self.done[rid] for rid in self.asked if rid in self.done]


def _remote(name: str, blocking: bool) -> Callable:
    """The client's method `name`: `SqliteStore`'s signature and docstring, one request."""
    local = getattr(SqliteStore, name)
    signature = inspect.signature(local)  # the wire's models are built on the first call (api.methods)

    waits = name == "wait_for_rollouts"  # a long wait is several requests (`_wait`)

    if blocking:

        def call(self: SyncStoreClient, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs).arguments
            bound.pop("self")
            if waits:
                return self._wait(bound["rollout_ids"], bound.get("timeout"))
            return self._call(methods()[name], bound)

    else:

        async def call(self: StoreClient, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            bound = signature.bind(self, *args, **kwargs).arguments
            bound.pop("self")
            if waits:
                return await self._wait(bound["rollout_ids"], bound.get("timeout"))
            return await self._call(methods()[name], bound)

    return functools.wraps(local)(call)


def _install() -> None:
    for name in METHODS:
        setattr(StoreClient, name, _remote(name, blocking=False))
        setattr(SyncStoreClient, name, _remote(name, blocking=True))


_install()
