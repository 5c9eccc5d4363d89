"""What the route's endpoints share about HTTP: server-sent events, concurrent choices, disconnects, the scope."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from pydantic import BaseModel


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def scope_key(request: Request) -> tuple[str, str] | None:
    """(rollout_id, attempt_id) of a rollout route, unchecked; None on /v1."""
    rollout_id = request.path_params.get("rollout_id")
    return None if rollout_id is None else (rollout_id, request.path_params["attempt_id"])


def sse_line(obj: BaseModel | dict) -> str:
    payload = obj.model_dump() if isinstance(obj, BaseModel) else obj
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def interleaved(
    jobs: Sequence[Callable[[Callable[[Any], Awaitable[None]]], Awaitable[None]]],
) -> AsyncIterator[Any]:
    """Run ``jobs`` concurrently, each called with a ``put`` for its items; yield the items as they
    come. A job's exception is raised here; closing the iterator cancels the jobs."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def run(job: Callable[[Callable[[Any], Awaitable[None]]], Awaitable[None]]) -> None:
        try:
            await job(queue.put)
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(run(job)) for job in jobs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def unless_disconnected(request: Request, work: Awaitable) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGone``.

    The body has been read, so the next ASGI message can only be the disconnect.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(work)
    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not work.done()
        if gone:  # the client left, or this handler itself is being cancelled
            work.cancel()
            work.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it now
    if gone:
        raise ClientGone()
    return work.result()
