"""Run state for exact resume: run info, per-step metrics and checkpoints, a part
of `SqliteStore` (which forwards its public methods here).

Exact resume needs, in one consistent snapshot: the step, the policy version,
the LoRA adapter weights and optimizer state, the data-loader cursor, the RNG
states and the run's config. `save_checkpoint` writes all of a step's state in
one transaction (and flushes it to disk even under synchronous=NORMAL), so a
crash leaves either the previous checkpoint or the new one, never a mix.

The rollouts of a step live in the same file, tagged with `metadata["step"]`
(indexed: `query_rollouts(step=n)`), and `enqueue_rollouts` adds a step's
batch atomically. Resuming is therefore:

    ckpt = await store.load_checkpoint()          # None: fresh run
    step = 0 if ckpt is None else ckpt.step + 1   # restore weights/RNG/cursor from ckpt
    batch = await store.query_rollouts(step=step)
    if not batch:                                  # the crash came before the enqueue
        batch = await store.enqueue_rollouts(inputs, metadata={"step": step})
    done = await store.wait_for_rollouts([r.rollout_id for r in batch])

Attempts the crashed process owned were already made `unresponsive` when the
store reopened (rule R7), and their rollouts requeued without using up a retry.

Only the last `keep_checkpoints` checkpoints keep their blobs; older ones keep
their JSON state and metrics, so the file does not grow with every step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from numbers import Number
from typing import Any, Optional

from agl.store.codec import dumps
from agl.store.db import Db, Where
from agl.store.txn import Tx
from agl.types import Checkpoint

_CHECKPOINT_COLUMNS = "step, policy_version, state, created_time, blobs_pruned"


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"reward": {"mean": 1.0}} -> {"reward/mean": 1.0}; values must be scalars."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, name + "/"))
            continue
        if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
            value = value.item()
        if isinstance(value, bool):
            value = int(value)
        if value is not None and not isinstance(value, (Number, str)):
            raise TypeError(f"metric {name!r} must be a number, a string or None, not {type(value).__name__}")
        flat[name] = value
    return flat


class RunState:
    def __init__(self, db: Db, keep_checkpoints: int):
        self.db = db
        self.keep_checkpoints = keep_checkpoints

    # -- run info ----------------------------------------------------------------

    async def set_run_info(self, key: str, value: Any) -> None:
        def write(tx: Tx) -> None:
            tx.conn.execute(
                "INSERT INTO run_info (key, value, update_time) VALUES (?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value, update_time = excluded.update_time",
                (key, dumps(value), tx.now),
            )

        await self.db.write(write)

    async def get_run_info(self, key: str, default: Any) -> Any:
        def read(conn: Any) -> Any:
            row = conn.execute("SELECT value FROM run_info WHERE key = ?", (key,)).fetchone()
            return default if row is None else json.loads(row["value"])

        return await self.db.read(read)

    async def get_all_run_info(self) -> dict[str, Any]:
        def read(conn: Any) -> dict[str, Any]:
            return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM run_info ORDER BY key")}

        return await self.db.read(read)

    # -- metrics -----------------------------------------------------------------

    @staticmethod
    def _log_metrics_tx(tx: Tx, step: int, metrics: Mapping[str, Any]) -> None:
        tx.conn.executemany(
            "INSERT INTO metrics (step, name, value, time) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(step, name) DO UPDATE SET value = excluded.value, time = excluded.time",
            [(step, name, value, tx.now) for name, value in flatten_metrics(metrics).items()],
        )

    async def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        await self.db.write(self._log_metrics_tx, int(step), dict(metrics))

    async def query_metrics(self, step: Optional[int], names: Optional[list[str]]) -> dict[int, dict[str, Any]]:
        def read(conn: Any) -> dict[int, dict[str, Any]]:
            where = Where()
            if step is not None:
                where.add("step = ?", step)
            if names is not None:
                where.add("name IN (SELECT value FROM json_each(?))", dumps(names))
            out: dict[int, dict[str, Any]] = {}
            for s, name, value in conn.execute(
                f"SELECT step, name, value FROM metrics{where} ORDER BY step, name", where.params
            ):
                out.setdefault(s, {})[name] = value
            return out

        return await self.db.read(read)

    # -- checkpoints -------------------------------------------------------------

    def _save_checkpoint_tx(
        self,
        tx: Tx,
        step: int,
        policy_version: int,
        state_json: str,
        blobs: dict[str, bytes],
        metrics: Optional[Mapping[str, Any]],
    ) -> float:
        conn = tx.conn
        conn.execute("DELETE FROM checkpoint_blobs WHERE step = ?", (step,))
        conn.execute("DELETE FROM checkpoints WHERE step = ?", (step,))
        conn.execute(
            "INSERT INTO checkpoints (step, policy_version, state, created_time) VALUES (?, ?, ?, ?)",
            (step, policy_version, state_json, tx.now),
        )
        conn.executemany(
            "INSERT INTO checkpoint_blobs (step, name, data) VALUES (?, ?, ?)",
            [(step, name, bytes(data)) for name, data in blobs.items()],
        )
        if metrics:
            self._log_metrics_tx(tx, step, metrics)
        # Keep the blobs of the newest `keep_checkpoints` checkpoints only.
        old = [
            row["step"]
            for row in conn.execute(
                "SELECT step FROM checkpoints WHERE blobs_pruned = 0 ORDER BY step DESC LIMIT -1 OFFSET ?",
                (self.keep_checkpoints,),
            )
        ]
        for s in old:
            conn.execute("DELETE FROM checkpoint_blobs WHERE step = ?", (s,))
            conn.execute("UPDATE checkpoints SET blobs_pruned = 1 WHERE step = ?", (s,))
        return tx.now

    async def save_checkpoint(
        self,
        step: int,
        policy_version: int,
        state: Mapping[str, Any],
        blobs: Optional[Mapping[str, bytes]],
        metrics: Optional[Mapping[str, Any]],
    ) -> Checkpoint:
        state_json = dumps(dict(state))
        blob_map = dict(blobs or {})
        created = await self.db.write(
            self._save_checkpoint_tx,
            int(step),
            int(policy_version),
            state_json,
            blob_map,
            dict(metrics) if metrics else None,
            durable=True,
        )
        return Checkpoint(
            step=step,
            policy_version=policy_version,
            state=json.loads(state_json),
            blobs=blob_map,
            metrics=flatten_metrics(metrics or {}),
            created_time=created,
        )

    async def load_checkpoint(self, step: Optional[int]) -> Optional[Checkpoint]:
        def read(conn: Any) -> Optional[Checkpoint]:
            if step is None:
                row = conn.execute(
                    f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints ORDER BY step DESC LIMIT 1"
                ).fetchone()
            else:
                row = conn.execute(f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints WHERE step = ?", (step,)).fetchone()
            if row is None:
                return None
            s = row["step"]
            blobs = {n: d for n, d in conn.execute("SELECT name, data FROM checkpoint_blobs WHERE step = ?", (s,))}
            metrics = {n: v for n, v in conn.execute("SELECT name, value FROM metrics WHERE step = ?", (s,))}
            return _checkpoint(row, blobs=blobs, metrics=metrics)

        return await self.db.read(read)

    async def list_checkpoints(self) -> list[Checkpoint]:
        def read(conn: Any) -> list[Checkpoint]:
            return [
                _checkpoint(row) for row in conn.execute(f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints ORDER BY step")
            ]

        return await self.db.read(read)


def _checkpoint(row: Mapping[str, Any], **extra: Any) -> Checkpoint:
    return Checkpoint(
        step=row["step"],
        policy_version=row["policy_version"],
        state=json.loads(row["state"]),
        created_time=row["created_time"],
        blobs_pruned=bool(row["blobs_pruned"]),
        **extra,
    )
