"""The one thread that runs a process's model work: the engines' steps, the updates, loading and saving a policy.

torch's CPU kernels run their parallel regions on OpenMP (libgomp). libgomp gives every thread that opens a
parallel region a pool of workers of its own, and between two regions a worker spins a while (``GOMP_SPINCOUNT``)
before it sleeps. A decode step opens ~150 regions (four matmuls and an attention a layer, the head), so whether
the worker is still spinning when the next one opens is most of a small step's cost: a futex wake-up of a sleeping
worker costs tens of microseconds on a VM. Two things made every wake-up a sleeping one:

  - ``OMP_WAIT_POLICY=PASSIVE`` (harness.py used to set it): no spin at all;
  - model work spread over several threads (the engine's own, ``asyncio.to_thread``'s for loading and updates):
    one pool each, and once the pools' workers outnumber the cores libgomp spins only ~100 times.

Here there is one such thread, so one pool, whose worker spins through a step's regions and sleeps between steps
(libgomp's default: ~300,000 spins, a few milliseconds). What it gained and what it costs:
docs/benchmarks-history.md#one-compute-thread.

The price: two such processes on the same cores each hold a core the other waits for; two jobs started by hand
on one machine should set ``OMP_WAIT_POLICY=PASSIVE`` (a sweep's launchers split the cores instead:
agl.jobs.launchers), as the test suite does.

``run(fn, ...)`` awaits ``fn`` on it; ``call(fn, ...)`` blocks on it (scripts without an event loop: bench/);
``executor()`` is the thread for ``loop.run_in_executor``. Work runs one
call at a time, in submission order, which the engines and the trainers already assumed (an update runs while
the engines are paused). ``set_threads(n)`` sizes its OpenMP team (``torch.set_num_threads`` is per thread).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")

NAME = "agl-compute"  # the thread's name
_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_threads: int | None = None  # torch threads on the compute thread; None: torch's default there


def _start() -> None:
    if _threads is not None:
        torch.set_num_threads(_threads)


def executor() -> ThreadPoolExecutor:
    """The compute thread (started at the first call)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=NAME, initializer=_start)
        return _executor


def set_threads(threads: int) -> None:
    """Run the compute thread's torch work on ``threads`` threads (harness: the job's ``threads``)."""
    global _threads
    _threads = threads
    if _executor is not None:
        _executor.submit(torch.set_num_threads, threads).result()


async def run(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``await fn(*args, **kwargs)`` run on the compute thread, in the caller's context (as ``asyncio.to_thread``)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(executor(), call)


def call(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the compute thread, blocking the caller; called on the compute thread, it runs there
    at once (a single worker waiting on itself would never return)."""
    if threading.current_thread().name.startswith(NAME):
        return fn(*args, **kwargs)
    return executor().submit(fn, *args, **kwargs).result()


def _forget_after_fork() -> None:  # a forked child has the executor object but not its thread
    global _executor, _lock
    _executor, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
