"""``algo=store``: the run dir's store served over HTTP until Ctrl-C or SIGTERM (agl/store/server.py).

    python harness.py algo=store store.port=4747                                   # this machine only
    python harness.py algo=store store.host=0.0.0.0 store.api_key=<secret>         # for other hosts

Then jobs, runners and algorithms on any host join by URL: a training job with
``store.url=http://<host>:4747``, runners with ``algo=runner store.url=...``, your own algorithm with
``agl.StoreClient(url, api_key=...)`` (docs/running.md, "Beyond one machine"). The store is
``<run dir>/store.sqlite`` (``hydra.run.dir=...`` picks the dir; serving a dir again serves its store again,
with its clients' sessions), and this process is its one writer: the run dir's lock is held while it serves.
Its watchdog applies the deadlines and ends the sessions of clients whose heartbeats stopped
(``store.session_timeout``).

It loads no model and no torch. Stopping it ends no client's session: a server started again on the same
file gives them a whole ``store.session_timeout`` to find it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from pathlib import Path

from agl.config import Config
from agl.errors import ConfigError
from agl.store import SqliteStore
from agl.store.server import StoreServer


async def serve_store(config: Config, run_dir: Path) -> dict:
    settings = config.store
    if settings.url:
        raise ConfigError(
            f"algo=store serves {run_dir / 'store.sqlite'}; store.url={settings.url} names a store served elsewhere "
            "(leave it out here)"
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as parts:
        for sig in (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ():
            loop.add_signal_handler(sig, stop.set)
            parts.callback(loop.remove_signal_handler, sig)
        store = await parts.enter_async_context(await SqliteStore.open(run_dir / "store.sqlite"))  # + its watchdog
        server = StoreServer.of(store, settings)
        await server.start()
        parts.push_async_callback(server.stop)
        print(f"serving the store {store.path} at {server.url} (store.url={server.url}); stop with Ctrl-C", flush=True)
        await stop.wait()
    print(f"stopped serving {run_dir / 'store.sqlite'}", flush=True)
    return {"url": server.url, "store": str(run_dir / "store.sqlite")}


def run(config: Config, run_dir: Path) -> object:
    """``algo=store``: what ``agl.jobs.dispatch`` calls."""
    return asyncio.run(serve_store(config, run_dir))
