"""The store served over HTTP: `SqliteStore`'s API for clients on any host (`agl.StoreClient`, client.py).

    python harness.py algo=store store.port=4747            # agl.jobs.store: this server on a run dir's store

The SQLite file stays the one writer: the server is a process that owns a `SqliteStore` (its worker thread,
its watchdog) and answers each request with one call of it. What a client sees is what a local store does:
the same methods (api.py derives their arguments and results from `SqliteStore`'s signatures), the same
status rules, the same errors (a `ValueError` for an unknown id is a `ValueError` again on the client side).

Routes (JSON bodies; every route but `GET /health` needs `Authorization: Bearer <key>` when the server has
a key, else 401):

    POST   /v1/store/<method>            one call of the store's <method> (api.METHODS); the body holds its
                                         arguments by name, the reply its result
    POST   /v1/sessions                  open a client session: {"hostname", "pid"} -> {"session_id",
                                         "heartbeat_seconds"}
    POST   /v1/sessions/<id>/heartbeat   the session is alive; 409 once it has ended
    DELETE /v1/sessions/<id>             end it (R7: its attempts go back to the queue uncharged)
    GET    /health                       {"status": "ok"}, without a key (for load balancers)

Sessions. Each client has a store session of its own (rules.py R7), and a call that names it in its
`X-AGL-Session` header is made for it: the attempts it dequeues are its own, and once the session has ended
its writes are refused whole (409, `SessionEnded`), since its attempts went back to the queue. Its liveness
is its heartbeats, not a pid: a session with no heartbeat for `heartbeat_seconds` (`store.session_timeout`)
is ended as dead by the store's watchdog, so a runner host that dies or is cut off costs its rollouts
nothing (their next attempts are not charged). A server that starts again gives every open session a whole
deadline from then (`SqliteStore.renew_leases`).

Errors come back as `{"error": {"type": <exception class>, "message": ...}}`: 400 for ValueError and
TypeError (the request's or the store's), 401 for a missing or wrong key, 403 for a read-only store, 404 for
an unknown method, 409 for an ended session, 503 for a store that is closed, 507 for a full disk; the client
raises the same class again.

Guarded like the route: bound beyond the loopback, it refuses to start without a key
(`check_exposure`, `store.allow_public` to opt out). It speaks plain HTTP; docs/running.md says how to add
TLS (uvicorn's ssl options, or a reverse proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from typing import TYPE_CHECKING, Any

import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agl.config import check_exposure, store_ssl
from agl.errors import ConfigError, DiskFull
from agl.store.api import KEEPALIVE_S, MAX_WAIT_S, SESSION_HEADER, Method, methods
from agl.store.db import ReadOnlyStoreError
from agl.store.sessions import SessionEnded
from agl.store.store import SqliteStore

if TYPE_CHECKING:
    from agl.config import StoreConfig

log = logging.getLogger(__name__)

# exception class -> HTTP status; the client raises the class again (client.py's ERRORS)
STATUS = (
    (SessionEnded, 409),
    (ReadOnlyStoreError, 403),
    (DiskFull, 507),
    (ConfigError, 500),  # StoreDamaged: the file is damaged, which no request can fix
    (ValueError, 400),  # pydantic's ValidationError too
    (TypeError, 400),
    (KeyError, 400),
    (RuntimeError, 503),  # the store is closed (the server is stopping)
)


def error_response(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status)


def exception_response(error: BaseException) -> JSONResponse:
    status = next((code for cls, code in STATUS if isinstance(error, cls)), 500)
    if status == 500:
        log.exception("store request failed", exc_info=error)
    kind = "ValueError" if isinstance(error, ValidationError) else type(error).__name__
    return error_response(status, kind, str(error))


class SessionRequest(BaseModel):
    hostname: str
    pid: int


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (port 0: a free one) for uvicorn to serve on. Made with ``IPPROTO_TCP`` named: asyncio
    sets ``TCP_NODELAY`` only on accepted sockets whose ``proto`` says TCP, and an accepted socket has its
    listener's. Without it (``socket.socket(AF_INET, SOCK_STREAM)`` has proto 0) a reply's body, written after its
    headers, waits for the client's delayed ACK: about 40 ms a request (bench/store.py --client)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _UvicornWithoutSignals(uvicorn.Server):
    """uvicorn without its signal handlers: Ctrl-C belongs to the process that serves, not to uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Embedded:
    """An ASGI app served by uvicorn as a task of the caller's event loop, on a socket of `listening_socket`'s:
    the store's server and the model route (agl/route/server.py) both run so, in the process that owns what
    they serve."""

    def __init__(self, name: str):
        self.name = name
        self._server: _UvicornWithoutSignals | None = None
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    async def start(self, app: Starlette, sock: socket.socket, **options: Any) -> None:
        """Serve ``app`` on ``sock`` (uvicorn's ``options`` beside the defaults); return once it serves."""
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5, **options
        )
        self._server = _UvicornWithoutSignals(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=self.name)
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise why it could not start
                raise RuntimeError(f"{self.name} stopped during startup")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop serving (requests in flight get uvicorn's graceful shutdown); idempotent."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = self._server = None


class StoreServer:
    """`store` over HTTP on the caller's event loop (see the module docstring).

    Args:
        store: the store to serve (its lifecycle is the caller's: open before `start`, close after `stop`).
        host, port: where to listen (port 0: a free one, known after `start`).
        api_key: required of every request as `Authorization: Bearer <key>`; None: no key (loopback only,
            unless `allow_public`).
        session_timeout: seconds without a heartbeat after which a client's session is ended (R7).
        ssl: uvicorn's TLS options (`ssl_certfile`, `ssl_keyfile`, ...), to serve HTTPS itself.
    """

    def __init__(
        self,
        store: SqliteStore,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        allow_public: bool = False,
        session_timeout: float = 30.0,
        ssl: dict[str, Any] | None = None,
    ):
        check_exposure("store", host, api_key, allow_public)
        if not session_timeout > 0:
            raise ConfigError(f"store.session_timeout must be positive, not {session_timeout}")
        self.store = store
        self.host, self.port, self.api_key = host, port, api_key
        self.session_timeout = float(session_timeout)
        self.ssl = dict(ssl or {})
        self.app = self._build_app()
        self._serving = Embedded("agl-store-server")

    @classmethod
    def of(cls, store: SqliteStore, settings: StoreConfig) -> StoreServer:
        """The server ``store.*`` (``agl.config.StoreConfig``) describes, of ``store``."""
        return cls(
            store,
            host=settings.host,
            port=settings.port,
            api_key=settings.api_key,
            allow_public=settings.allow_public,
            session_timeout=settings.session_timeout,
            ssl=store_ssl(settings),
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        """Bind (port 0 picks a free port, known right away) and serve as a task on this loop."""
        if self._serving.running:
            return
        await self.store.renew_leases()  # the clients get a whole deadline from now to find this server
        try:
            sock = listening_socket(self.host, self.port)
        except OSError as error:
            raise ConfigError(
                f"the store cannot listen on {self.host}:{self.port}: {error.strerror or error} "
                "(choose another store.port, or store.port=0 for a free one)"
            ) from None
        self.port = sock.getsockname()[1]
        # keep-alive: longer than a client keeps an idle connection (api.KEEPALIVE_S), so the client always
        # closes it first and a request never races the server closing the connection it was sent on
        await self._serving.start(self.app, sock, timeout_keep_alive=KEEPALIVE_S * 3, **self.ssl)

    async def stop(self) -> None:
        """Stop serving (requests in flight get uvicorn's graceful shutdown). The clients' sessions stay
        open: a server started again on the same file takes them back."""
        await self._serving.stop()

    async def __aenter__(self) -> StoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ app

    def _build_app(self) -> Starlette:
        """Plain Starlette routes, each checking the key itself: a middleware (or FastAPI's request
        machinery) would cost a call more than the store does (bench/store.py)."""
        routes = [
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/sessions", self._open_session, methods=["POST"]),
            Route("/v1/sessions/{session_id}/heartbeat", self._heartbeat, methods=["POST"]),
            Route("/v1/sessions/{session_id}", self._end_session, methods=["DELETE"]),
            *(Route(f"/v1/store/{m.name}", self._endpoint(m), methods=["POST"]) for m in methods().values()),
            Route("/v1/store/{name}", self._unknown, methods=["POST"]),
        ]
        return Starlette(routes=routes)

    def _denied(self, request: Request) -> Response | None:
        """401 unless the request carries the key (when the server has one)."""
        if self.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return None
        return error_response(
            401, "PermissionError", "missing or wrong key (the store expects 'Authorization: Bearer <key>')"
        )

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _unknown(self, request: Request) -> Response:
        return self._denied(request) or error_response(
            404, "AttributeError", f"the store has no method {request.path_params['name']!r}"
        )

    def _endpoint(self, method: Method) -> Any:
        call = getattr(self.store, method.name)
        waits = method.name == "wait_for_rollouts"

        async def endpoint(request: Request) -> Response:
            if denied := self._denied(request):
                return denied
            try:
                arguments = method.decode_arguments(await request.body())
                if waits:  # one request waits MAX_WAIT_S at most; the client asks again for the rest
                    timeout = arguments.get("timeout")
                    arguments["timeout"] = MAX_WAIT_S if timeout is None else min(timeout, MAX_WAIT_S)
                with SqliteStore.acting_for(request.headers.get(SESSION_HEADER)):
                    result = await call(**arguments)
                return Response(method.encode_result(result), media_type="application/json")
            except Exception as error:  # noqa: BLE001 (every error goes back to the client, typed)
                return exception_response(error)

        return endpoint

    async def _open_session(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        try:
            body = SessionRequest.model_validate_json(await request.body())
            session_id = await self.store.open_client_session(body.hostname, body.pid, self.session_timeout)
        except Exception as error:  # noqa: BLE001
            return exception_response(error)
        log.info("store session %s opened for %s (pid %d)", session_id, body.hostname, body.pid)
        return JSONResponse({"session_id": session_id, "heartbeat_seconds": self.session_timeout})

    async def _heartbeat(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        session_id = request.path_params["session_id"]
        try:
            if not await self.store.heartbeat_session(session_id):
                return error_response(409, "SessionEnded", f"store session {session_id} has ended")
        except Exception as error:  # noqa: BLE001
            return exception_response(error)
        return JSONResponse({"session_id": session_id})

    async def _end_session(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        session_id = request.path_params["session_id"]
        try:
            ended = await self.store.end_session(session_id, "closed")
        except Exception as error:  # noqa: BLE001
            return exception_response(error)
        return JSONResponse({"session_id": session_id, "attempts_requeued": [a.attempt_id for a in ended]})
