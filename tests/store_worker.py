"""Subprocess side of the store's multi-process and crash tests.

    python tests/store_worker.py dequeue PATH      drain the queue after "go" on stdin, report,
                                                   close after the next line (or EOF)
    python tests/store_worker.py crash PATH SEED    write forever, reporting each commit
    python tests/store_worker.py checkpoint PATH   save checkpoints forever

Every line printed reports something that is already committed, so the parent
can check after a SIGKILL that nothing it was told about was lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl.store import SqliteStore  # noqa: E402
from agl.types import RolloutConfig, Span  # noqa: E402


def say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


async def dequeue(path: str) -> None:
    store = SqliteStore(path, watchdog_interval=None)
    say("ready")
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    got = []
    while (attempted := await store.dequeue_rollout(worker_id=f"proc-{os.getpid()}")) is not None:
        got.append(attempted.rollout_id)
    say(json.dumps(got))
    # Closing requeues the attempts still open (R7), so the parent says when.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await store.close()


RETRY = RolloutConfig(max_attempts=3, retry_condition=["unresponsive", "failed"])


async def crash(path: str, seed: int) -> None:
    rng = random.Random(seed)
    store = SqliteStore(path, watchdog_interval=None)
    say("ready", store.session_id)
    tokens = list(range(200))
    logprobs = [-0.25] * 200
    batch = 0
    while True:
        config = RETRY if rng.random() < 0.5 else None
        if rng.random() < 0.2:
            batch += 1
            rollouts = await store.enqueue_rollouts(
                [{"i": i} for i in range(5)], config=config, metadata={"batch": f"{seed}-{batch}"}
            )
            for r in rollouts:
                say("E", r.rollout_id)
        else:
            r = await store.enqueue_rollout({"x": rng.random()}, config=config)
            say("E", r.rollout_id)
        attempted = await store.dequeue_rollout(worker_id="crasher")
        if attempted is None:
            continue
        say("D", attempted.rollout_id, attempted.attempt.attempt_id)
        for _ in range(rng.randint(0, 3)):
            span = await store.add_span(
                Span(
                    rollout_id=attempted.rollout_id,
                    attempt_id=attempted.attempt.attempt_id,
                    name="llm.chat",
                    prompt_token_ids=tokens,
                    response_token_ids=tokens,
                    response_logprobs=logprobs,
                    attributes={"policy_version": 1},
                )
            )
            say("S", attempted.rollout_id, span.sequence_id)
        roll = rng.random()
        if roll < 0.5:
            status = "succeeded" if roll < 0.4 else "failed"
            await store.update_attempt(attempted.rollout_id, attempted.attempt.attempt_id, status=status)
            say("F", attempted.rollout_id, attempted.attempt.attempt_id, status)
        # else: leave the attempt running; the crash orphans it


async def checkpoint(path: str) -> None:
    store = SqliteStore(path, watchdog_interval=None, keep_checkpoints=2)
    say("ready")
    step = (await store.load_checkpoint() or type("C", (), {"step": 0})).step
    while True:
        step += 1
        blob = os.urandom(1 << 20) * 2  # 2 MB
        await store.save_checkpoint(
            step,
            step,
            {"sha": hashlib.sha256(blob).hexdigest(), "cursor": step * 8},
            {"adapter": blob, "optimizer": blob[:1000]},
            {"loss": 1.0 / step},
        )
        say("C", step)


def main() -> None:
    mode, path, *rest = sys.argv[1:]
    if mode == "dequeue":
        asyncio.run(dequeue(path))
    elif mode == "crash":
        asyncio.run(crash(path, int(rest[0])))
    elif mode == "checkpoint":
        asyncio.run(checkpoint(path))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
