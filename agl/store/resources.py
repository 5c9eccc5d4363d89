"""Versioned resources (e.g. the LLM endpoint and policy version), as a mixin of
`SqliteStore`. The latest resources are the ones added or updated last; a
rollout created without `resources_id` gets their id (rule R1)."""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, TypeVar

from agl.store import txn
from agl.store.codec import dumps
from agl.store.txn import Tx
from agl.types import ResourcesUpdate

T = TypeVar("T")


class ResourcesMixin:
    # Provided by SqliteStore.
    async def _write(self, fn: Callable[..., T], *args: Any, durable: bool = False) -> T:  # pragma: no cover
        raise NotImplementedError

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def _resources_from_row(raw: Any) -> ResourcesUpdate:
        return ResourcesUpdate(resources_id=raw[0], resources=json.loads(raw[1]), create_time=raw[2], update_time=raw[3])

    def _add_resources_tx(self, tx: Tx, resources: dict[str, Any], resources_id: Optional[str]) -> ResourcesUpdate:
        version = tx.conn.execute("SELECT coalesce(max(version), 0) + 1 FROM resources").fetchone()[0]
        resources_id = resources_id or txn.new_resources_id(tx.conn, version)
        if tx.conn.execute("SELECT 1 FROM resources WHERE resources_id = ?", (resources_id,)).fetchone():
            raise ValueError(f"Resources {resources_id!r} already exist")
        tx.conn.execute(
            "INSERT INTO resources (resources_id, resources, version, create_time, update_time) VALUES (?, ?, ?, ?, ?)",
            (resources_id, dumps(resources), version, tx.now, tx.now),
        )
        return ResourcesUpdate(resources_id=resources_id, resources=resources, create_time=tx.now, update_time=tx.now)

    async def add_resources(self, resources: dict[str, Any], resources_id: Optional[str] = None) -> ResourcesUpdate:
        """Store a new resources version under a new id (or the given unused one); it
        becomes the latest, which rollouts created without resources_id get (R1)."""
        return await self._write(self._add_resources_tx, dict(resources), resources_id)

    def _update_resources_tx(self, tx: Tx, resources_id: str, resources: dict[str, Any]) -> ResourcesUpdate:
        raw = tx.conn.execute(
            "UPDATE resources SET resources = ?, update_time = ?, "
            "version = (SELECT max(version) + 1 FROM resources) WHERE resources_id = ? "
            "RETURNING resources_id, resources, create_time, update_time",
            (dumps(resources), tx.now, resources_id),
        ).fetchone()
        if raw is None:
            raise ValueError(f"Resources {resources_id!r} not found")
        return self._resources_from_row(raw)

    async def update_resources(self, resources_id: str, resources: dict[str, Any]) -> ResourcesUpdate:
        """Replace the content of existing resources; like agent-lightning, they also
        become the latest."""
        return await self._write(self._update_resources_tx, resources_id, dict(resources))

    async def get_resources_by_id(self, resources_id: str) -> Optional[ResourcesUpdate]:
        """The resources, or None if there is no such id."""

        def read(conn: Any) -> Optional[ResourcesUpdate]:
            raw = conn.execute(
                "SELECT resources_id, resources, create_time, update_time FROM resources WHERE resources_id = ?",
                (resources_id,),
            ).fetchone()
            return None if raw is None else self._resources_from_row(raw)

        return await self._read(read)

    async def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        def read(conn: Any) -> Optional[ResourcesUpdate]:
            raw = conn.execute(
                "SELECT resources_id, resources, create_time, update_time FROM resources "
                "ORDER BY version DESC LIMIT 1"
            ).fetchone()
            return None if raw is None else self._resources_from_row(raw)

        return await self._read(read)
