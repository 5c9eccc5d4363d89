"""``algo=serve``: the policy (base + ``model.adapter``) on the OpenAI-compatible route until stopped.

    python harness.py algo=serve model.adapter=<run dir> server.port=8000

The route is the one training uses (``agl.route.server``), over the same engine, with the policy
exactly as it was trained: the 4-bit base plus the LoRA. It prints the base URL and the model
name to send, and runs until Ctrl-C or SIGTERM, then stops the route (in-flight requests get
uvicorn's graceful shutdown), the engine and the store, and exits 0.

With ``algo.record`` (the default) every call is recorded in the run dir's ``store.sqlite`` as
training calls are: a rollout per call (``metadata.served``), one ``llm.*`` span per choice with
the exact prompt and sampled token ids, log-probs and the request. ``report=<run dir>`` counts
them; ``SqliteStore.open_readonly`` reads them, also while the server runs.

Rollouts of agents: once it serves, the job publishes its route in its store for runner processes
(``agl.agents.attach``), as a training job does, so the rollouts an algorithm of your own enqueues
(``agl.StoreClient``, examples/first_algorithm.py) are run by runners joined by ``attach=<run dir>``,
or by ``store.url`` when the store is served elsewhere (``store.url=...`` here too: the calls are then
recorded in that store). It runs no runners itself, and withdraws the entry when it stops.

Left out: hot-swapping adapters (one policy per process, as in training).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from pathlib import Path

from agl.agents.attach import RUNNERS_KEY, runner_entry
from agl.config import Config, client_api_key
from agl.errors import ConfigError
from agl.policy import compute_thread
from agl.policy.engine import Engine
from agl.policy.load import load_policy
from agl.policy.lora import find_adapter_dir
from agl.route.server import ModelServer
from agl.runtime import engine_kwargs, reachable
from agl.store import SqliteStore, StoreClient


async def run_serve(config: Config, run_dir: Path) -> dict:
    model, server_config = config.model, config.server
    if model.adapter:
        find_adapter_dir(model.adapter)  # a wrong path fails now, not after loading the base model
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as parts:  # stopped in reverse: route, engine, store
        # from now on a signal, even while loading, ends the job cleanly; only the main thread gets
        # signals (under agl.run in a notebook the job runs in a worker thread: interrupt the kernel)
        for sig in (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ():
            loop.add_signal_handler(sig, stop.set)
            parts.callback(loop.remove_signal_handler, sig)
        if config.store.url:  # a store served elsewhere (algo=store): calls and rollouts are recorded there
            store = await parts.enter_async_context(StoreClient(config.store.url, config.store.api_key))
        elif config.algo.record:  # a ServeConfig
            store = await parts.enter_async_context(SqliteStore(run_dir / "store.sqlite"))
        else:
            store = None
        policy = await compute_thread.run(load_policy, model, config.device)
        engine = Engine(policy, **engine_kwargs(config.engine, model.compute_dtype))
        await engine.start()
        parts.push_async_callback(engine.stop)
        server = ModelServer(engine, policy, store, server_config, seed=config.seed, record_unscoped=store is not None)
        try:
            await server.start()
        except OSError as error:
            raise ConfigError(
                f"cannot listen on {server_config.host}:{server_config.port}: {error.strerror or error} "
                "(choose another server.port, or server.port=0 for a free one)"
            ) from None
        parts.push_async_callback(server.stop)
        if store is not None:  # runners may join and run the rollouts an algorithm enqueues; withdrawn first at the end
            rollout_url = reachable(server.rollout_base_url("{rollout_id}", "{attempt_id}"), server_config.host)
            entry = runner_entry(
                rollout_url, policy.name, client_api_key(server_config), store.session_id, config.task, {}
            )
            await store.set_run_info(RUNNERS_KEY, entry)
            parts.push_async_callback(store.set_run_info, RUNNERS_KEY, None)
        recording = (
            f"recording calls in {store.path}" if store is not None else "not recording calls (algo.record=false)"
        )
        print(f"serving {server.base_url} (model {policy.name!r}); {recording}; stop with Ctrl-C", flush=True)
        await stop.wait()
        await server.stop()  # no call is recorded after this: the count below is final
        served = await store.query_rollouts() if store is not None else []
        calls = sum(1 for r in served if "served" in (r.metadata or {}))
    if store is not None:
        print(f"stopped; {calls} calls recorded (summary: python harness.py report={run_dir})")
    return {"base_url": server.base_url, "model": policy.name, "recorded_calls": calls}


def run(config: Config, run_dir: Path) -> object:
    """``algo=serve``: what ``agl.jobs.dispatch`` calls."""
    return asyncio.run(run_serve(config, run_dir))
