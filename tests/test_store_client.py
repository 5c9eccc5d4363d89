"""The store over HTTP (agl/store/server.py, client.py) where it differs from a local store: client sessions
that live by heartbeats, the key, the exposure guard, real sockets, the sync client, a server started again.
What it shares with the local store, the behaviour suite checks on both (tests/conftest.py's `store`)."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from store_helpers import FakeClock, check_invariants

from agl.errors import ConfigError
from agl.store import SessionEnded, SqliteStore, StoreClient, StoreUnreachable, SyncStoreClient
from agl.store.api import METHODS
from agl.store.rules import charged_attempt_number, is_harness_ended
from agl.store.server import StoreServer
from agl.types import Span

asyncio_test = pytest.mark.asyncio


def client(server: StoreServer, **kwargs) -> StoreClient:
    kwargs.setdefault("heartbeat_interval", 3600.0)
    return StoreClient("http://store", transport=httpx.ASGITransport(app=server.app), **kwargs)


def test_the_clients_methods_are_the_stores():
    for name in METHODS:
        store_method = getattr(SqliteStore, name)
        for cls, is_async in ((StoreClient, True), (SyncStoreClient, False)):
            method = getattr(cls, name)
            assert inspect.signature(method) == inspect.signature(store_method), (cls, name)
            assert method.__doc__ == store_method.__doc__ and inspect.iscoroutinefunction(method) == is_async


@asyncio_test
async def test_a_session_whose_heartbeats_stop_is_ended_and_its_rollouts_cost_nothing(path: Path, clock: FakeClock):
    local = SqliteStore(path, clock=clock, watchdog_interval=None)
    server = StoreServer(local, session_timeout=10)
    cut, alive, other = client(server), client(server, heartbeat_interval=0.01), client(server)
    try:
        rollouts = await local.enqueue_rollouts(["a", "b", "c"])  # max_attempts=1: a charged end would fail them
        taken = [await cut.dequeue_rollout(worker_id="cut") for _ in range(2)]
        kept = await alive.dequeue_rollout(worker_id="alive")
        clock.advance(9)
        await asyncio.sleep(0.1)  # `alive` heartbeats at the new time; `cut` never does
        assert await local.check_timeouts() == []
        clock.advance(2)
        await asyncio.sleep(0.1)
        ended = await local.check_timeouts()
        assert [a.attempt_id for a in ended] == [t.attempt.attempt_id for t in taken]
        assert all(a.status == "unresponsive" and a.metadata["harness_ended"] == "dead" for a in ended)
        assert [r.status for r in await local.query_rollouts()] == ["requeuing", "requeuing", "preparing"]
        assert await alive.session_alive(alive.session_id) and not await alive.session_alive(cut.session_id)
        # what the cut-off client reports no longer counts: refused whole, and the client says it is broken
        with pytest.raises(SessionEnded, match="has ended"):
            await cut.update_attempt(taken[0].rollout_id, "latest", status="succeeded")
        assert cut.broken and "has ended" in cut.broken
        with pytest.raises(StoreUnreachable, match="broken"):
            await cut.get_rollout_by_id(rollouts[0].rollout_id)
        # their next attempts are the agent's first tries still
        again = [await other.dequeue_rollout() for _ in range(2)]
        assert [(a.rollout_id, a.attempt.sequence_id) for a in again] == [(t.rollout_id, 2) for t in taken]
        for a in again:
            attempts = await other.query_attempts(a.rollout_id)
            assert is_harness_ended(attempts[0]) and charged_attempt_number(attempts, a.attempt) == 1
        await alive.update_attempt(kept.rollout_id, "latest", status="succeeded")
        # closing a client ends its session as closing a local store does: its attempts go back uncharged
        await other.close()
        assert [r.status for r in await local.query_rollouts()] == ["requeuing", "requeuing", "succeeded"]
        assert (await local.get_latest_attempt(again[0].rollout_id)).metadata["harness_ended"] == "closed"
    finally:
        for c in (cut, alive, other):
            await c.close()
        await local.close()
    assert check_invariants(path) == []


@asyncio_test
async def test_every_request_needs_the_key(path: Path):
    local = SqliteStore(path, watchdog_interval=None)
    server = StoreServer(local, api_key="sekret")
    transport = httpx.ASGITransport(app=server.app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://store") as raw:
            assert (await raw.get("/health")).json() == {"status": "ok"}  # for load balancers
            for headers in ({}, {"authorization": "Bearer wrong"}):
                for verb, route in (("POST", "/v1/store/query_rollouts"), ("POST", "/v1/sessions")):
                    reply = await raw.request(verb, route, headers=headers, content=b"{}")
                    assert reply.status_code == 401 and reply.json()["error"]["type"] == "PermissionError"
            reply = await raw.post("/v1/store/drop_table", headers={"authorization": "Bearer sekret"})
            assert (
                reply.status_code == 404 and reply.json()["error"]["message"] == "the store has no method 'drop_table'"
            )
        for key in (None, "wrong"):
            with pytest.raises(PermissionError, match="missing or wrong key"):
                await StoreClient("http://store", key, transport=transport).query_rollouts()
        keyed = StoreClient("http://store", "sekret", transport=transport)
        assert (await keyed.enqueue_rollout("x")).rollout_id == "ro-000001"
        await keyed.close()
    finally:
        await local.close()


@asyncio_test
async def test_a_store_beyond_the_loopback_needs_a_key(path: Path):
    local = SqliteStore(path, watchdog_interval=None)
    try:
        with pytest.raises(ConfigError, match=r"^store\.host=0\.0\.0\.0 is not a loopback address and store\.api_key"):
            StoreServer(local, host="0.0.0.0")
        StoreServer(local, host="0.0.0.0", api_key="sekret")
        StoreServer(local, host="0.0.0.0", allow_public=True)
    finally:
        await local.close()


@asyncio_test
async def test_real_sockets_the_sync_client_and_a_server_started_again(path: Path, monkeypatch):
    monkeypatch.setattr("agl.store.server.MAX_WAIT_S", 0.2)  # wait_for_rollouts: several requests per wait
    monkeypatch.setattr("agl.store.client.MAX_WAIT_S", 0.2)
    local = SqliteStore(path, watchdog_interval=0.05)

    async def serve(port: int = 0) -> StoreServer:  # the store server's process: its watchdog, its route
        await local.start_watchdog()
        server = StoreServer(local, port=port, session_timeout=1.0)
        await server.start()
        return server

    server = await serve()
    url = server.url
    try:
        enqueued = threading.Event()

        def algorithm() -> list:
            with SyncStoreClient(url) as store:  # agent-lightning's examples call the store so
                ids = [store.enqueue_rollout({"i": i}).rollout_id for i in range(3)]
                assert store.wait_for_rollouts(ids, timeout=0.5) == []  # three requests, nothing finished
                enqueued.set()
                return store.wait_for_rollouts(ids, timeout=60)

        waiting = asyncio.ensure_future(asyncio.to_thread(algorithm))
        runner = StoreClient(url)
        await runner.open()
        await asyncio.to_thread(enqueued.wait)
        # The server's process goes away for longer than the sessions' deadline and comes back. A request
        # that cannot connect (nothing was sent) waits for it, and the sessions are given a whole deadline from
        # the new start: neither client lost its session.
        await server.stop()
        await local.stop_watchdog()
        await asyncio.sleep(1.5)
        restart = asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(serve(server.port)))
        while (a := await runner.dequeue_rollout(worker_id="w")) is not None:
            await runner.add_span(Span(rollout_id=a.rollout_id, attempt_id=a.attempt.attempt_id, name="x"))
            await runner.update_attempt(a.rollout_id, "latest", status="succeeded")
        done = await waiting
        assert [r.status for r in done] == ["succeeded"] * 3 and [r.input for r in done] == [{"i": i} for i in range(3)]
        assert runner.broken is None and runner.disconnects >= 1  # its heartbeats saw the server gone
        assert await runner.session_alive(runner.session_id)
        await runner.close()
        del restart
        unreachable = StoreClient("http://127.0.0.1:9", connect_retry_s=0.2)
        with pytest.raises(StoreUnreachable, match="cannot reach the store"):
            await unreachable.query_rollouts()
        assert unreachable.broken
        await unreachable.close()
    finally:
        await StoreServer(local).stop()
        await local.close()
    assert check_invariants(path) == []


def test_a_sync_client_heartbeats_from_its_thread(tmp_path: Path):
    loop = asyncio.new_event_loop()
    started: list[str] = []
    stop = asyncio.Event()

    async def serve() -> None:
        async with SqliteStore(tmp_path / "store.sqlite", watchdog_interval=0.05) as local:
            async with StoreServer(local, port=0, session_timeout=0.5) as server:
                started.append(server.url)
                await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    while not started:
        time.sleep(0.01)
    try:
        with SyncStoreClient(started[0]) as store:
            got = store.start_rollout("x")
            time.sleep(1.5)  # three deadlines: its heartbeats (every 0.125 s) keep the session open
            assert store.get_latest_attempt(got.rollout_id).status == "preparing"
            assert store.session_alive(store.session_id)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)


@asyncio_test
async def test_https_with_uvicorns_ssl_options(path: Path, tmp_path: Path, monkeypatch):
    """store.ssl_certfile / store.ssl_keyfile: the server speaks TLS; a client trusts its CA (SSL_CERT_FILE)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    local = SqliteStore(path, watchdog_interval=None)
    server = StoreServer(local, port=0, api_key="sekret", ssl={"ssl_certfile": str(cert), "ssl_keyfile": str(key)})
    await server.start()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        async with StoreClient(server.url, "sekret") as secure:
            assert (await secure.enqueue_rollout("x")).rollout_id == "ro-000001"
        with pytest.raises(StoreUnreachable):  # plain HTTP to a TLS port: the connection fails, nothing is stored
            await StoreClient(server.url.replace("https", "http"), "sekret", connect_retry_s=0).query_rollouts()
    finally:
        await server.stop()
        await local.close()


def test_algo_store_beyond_the_loopback_without_a_key_is_refused_in_one_line(tmp_path: Path):
    from runs import harness

    proc = harness("algo=store", "store.host=0.0.0.0", f"hydra.run.dir={tmp_path}")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == (
        "error: store.host=0.0.0.0 is not a loopback address and store.api_key is not set, so anyone who can reach "
        "this machine could read and write the store: set store.api_key=<secret> (clients send it as the Bearer "
        "token), or store.allow_public=true to serve it without a key"
    )
    assert not (tmp_path / "store.sqlite").exists()  # refused before the store was opened


class _ResetAfterSending(httpx.HTTPTransport):
    """Real sockets; the first request to each of ``paths`` reaches the server, then its connection is reset."""

    def __init__(self, *paths: str):
        super().__init__()
        self.left = set(paths)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path in self.left:
            self.left.discard(request.url.path)
            response.read()
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        return response


class _AsyncResetAfterSending(httpx.AsyncHTTPTransport):
    def __init__(self, *paths: str):
        super().__init__()
        self.left = set(paths)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path in self.left:
            self.left.discard(request.url.path)
            await response.aread()
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        return response


@asyncio_test
async def test_a_wait_whose_connection_resets_after_sending_is_sent_again(path: Path):
    """A server that stops or restarts resets the long polls in flight (CI met it once, in the test above). A wait
    only reads, so both clients send it again; a write whose outcome is unknown still breaks the client."""
    local = SqliteStore(path)
    async with StoreServer(local, port=0) as server:
        wait, enqueue = "/v1/store/wait_for_rollouts", "/v1/store/enqueue_rollout"
        rollout = await local.enqueue_rollout({"i": 0})
        await local.update_rollout(rollout.rollout_id, status="succeeded")

        def sync_calls() -> list:
            with SyncStoreClient(server.url, transport=_ResetAfterSending(wait, enqueue)) as store:
                done = store.wait_for_rollouts([rollout.rollout_id], timeout=5)
                with pytest.raises(StoreUnreachable, match="Connection reset"):
                    store.enqueue_rollout({"i": 1})
                return done

        assert [r.rollout_id for r in await asyncio.to_thread(sync_calls)] == [rollout.rollout_id]
        store = StoreClient(server.url, transport=_AsyncResetAfterSending(wait, enqueue))
        await store.open()
        try:
            done = await store.wait_for_rollouts([rollout.rollout_id], timeout=5)
            assert [r.rollout_id for r in done] == [rollout.rollout_id]
            with pytest.raises(StoreUnreachable, match="Connection reset"):
                await store.enqueue_rollout({"i": 2})
        finally:
            await store.close()
    await local.close()
