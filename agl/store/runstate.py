"""Run state for exact resume: run info, per-step metrics and checkpoints.

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
from numbers import Number
from typing import Any, Callable, Mapping, Optional, TypeVar

from agl.store.codec import dumps
from agl.store.txn import Tx
from agl.types import Checkpoint

T = TypeVar("T")


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


class RunStateMixin:
    """Run-state methods of `SqliteStore` (kept here: one job per module)."""

    _keep_checkpoints: int

    # Provided by SqliteStore.
    async def _write(self, fn: Callable[..., T], *args: Any, durable: bool = False) -> T:  # pragma: no cover
        raise NotImplementedError

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:  # pragma: no cover - interface
        raise NotImplementedError

    # -- run info ----------------------------------------------------------------

    async def set_run_info(self, key: str, value: Any) -> None:
        """Store a JSON-able value under `key` (e.g. "config", "git_commit")."""

        def write(tx: Tx) -> None:
            tx.conn.execute(
                "INSERT INTO run_info (key, value, update_time) VALUES (?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value, update_time = excluded.update_time",
                (key, dumps(value), tx.now),
            )

        await self._write(write)

    async def get_run_info(self, key: str, default: Any = None) -> Any:
        def read(conn: Any) -> Any:
            raw = conn.execute("SELECT value FROM run_info WHERE key = ?", (key,)).fetchone()
            return default if raw is None else json.loads(raw[0])

        return await self._read(read)

    async def get_all_run_info(self) -> dict[str, Any]:
        def read(conn: Any) -> dict[str, Any]:
            return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM run_info ORDER BY key")}

        return await self._read(read)

    # -- metrics -----------------------------------------------------------------

    @staticmethod
    def _log_metrics_tx(tx: Tx, step: int, metrics: Mapping[str, Any]) -> None:
        tx.conn.executemany(
            "INSERT INTO metrics (step, name, value, time) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(step, name) DO UPDATE SET value = excluded.value, time = excluded.time",
            [(step, name, value, tx.now) for name, value in flatten_metrics(metrics).items()],
        )

    async def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record metrics of a step (nested dicts flattened with '/'); a name logged
        again for the same step replaces the old value."""
        await self._write(self._log_metrics_tx, int(step), dict(metrics))

    async def query_metrics(
        self, step: Optional[int] = None, names: Optional[list[str]] = None
    ) -> dict[int, dict[str, Any]]:
        """{step: {name: value}} in step order, optionally for one step / some names."""

        def read(conn: Any) -> dict[int, dict[str, Any]]:
            where, params = [], []
            if step is not None:
                where.append("step = ?")
                params.append(step)
            if names is not None:
                where.append("name IN (SELECT value FROM json_each(?))")
                params.append(dumps(names))
            sql = "SELECT step, name, value FROM metrics"
            if where:
                sql += " WHERE " + " AND ".join(where)
            out: dict[int, dict[str, Any]] = {}
            for s, name, value in conn.execute(sql + " ORDER BY step, name", params):
                out.setdefault(s, {})[name] = value
            return out

        return await self._read(read)

    # -- checkpoints -------------------------------------------------------------

    def _save_checkpoint_tx(
        self, tx: Tx, step: int, policy_version: int, state_json: str,
        blobs: dict[str, bytes], metrics: Optional[Mapping[str, Any]],
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
            r[0]
            for r in conn.execute(
                "SELECT step FROM checkpoints WHERE blobs_pruned = 0 ORDER BY step DESC LIMIT -1 OFFSET ?",
                (self._keep_checkpoints,),
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
        blobs: Optional[Mapping[str, bytes]] = None,
        metrics: Optional[Mapping[str, Any]] = None,
    ) -> Checkpoint:
        """Atomically save the run state after `step` (replacing a checkpoint of the
        same step): JSON `state`, binary `blobs` (adapter weights, optimizer state,
        torch RNG, ...) and, if given, the step's metrics (as `log_metrics`)."""
        state_json = dumps(dict(state))
        blob_map = dict(blobs or {})
        created = await self._write(
            self._save_checkpoint_tx, int(step), int(policy_version), state_json, blob_map,
            dict(metrics) if metrics else None, durable=True,
        )
        return Checkpoint(
            step=step, policy_version=policy_version, state=json.loads(state_json), blobs=blob_map,
            metrics=flatten_metrics(metrics or {}), created_time=created,
        )

    async def load_checkpoint(self, step: Optional[int] = None) -> Optional[Checkpoint]:
        """The checkpoint of `step`, or the latest one (highest step); None if there is
        none. A checkpoint whose blobs were pruned comes back with `blobs_pruned=True`."""

        def read(conn: Any) -> Optional[Checkpoint]:
            if step is None:
                raw = conn.execute(
                    "SELECT step, policy_version, state, created_time, blobs_pruned FROM checkpoints "
                    "ORDER BY step DESC LIMIT 1"
                ).fetchone()
            else:
                raw = conn.execute(
                    "SELECT step, policy_version, state, created_time, blobs_pruned FROM checkpoints WHERE step = ?",
                    (step,),
                ).fetchone()
            if raw is None:
                return None
            s = raw[0]
            blobs = {n: d for n, d in conn.execute("SELECT name, data FROM checkpoint_blobs WHERE step = ?", (s,))}
            metrics = {n: v for n, v in conn.execute("SELECT name, value FROM metrics WHERE step = ?", (s,))}
            return Checkpoint(
                step=s, policy_version=raw[1], state=json.loads(raw[2]), blobs=blobs, metrics=metrics,
                created_time=raw[3], blobs_pruned=bool(raw[4]),
            )

        return await self._read(read)

    async def list_checkpoints(self) -> list[Checkpoint]:
        """All checkpoints, oldest step first, without their blobs (cheap)."""

        def read(conn: Any) -> list[Checkpoint]:
            return [
                Checkpoint(step=s, policy_version=pv, state=json.loads(st), created_time=ct, blobs_pruned=bool(bp))
                for s, pv, st, ct, bp in conn.execute(
                    "SELECT step, policy_version, state, created_time, blobs_pruned FROM checkpoints ORDER BY step"
                )
            ]

        return await self._read(read)
