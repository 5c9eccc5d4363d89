"""Versioned resources (e.g. the LLM endpoint and policy version), a part of
`SqliteStore` (which forwards its public methods here). The latest resources are
the ones added or updated last; a rollout created without `resources_id` gets
their id (rule R1)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Optional

import agl.store.txn as txn
from agl.store.codec import dumps
from agl.store.db import Db
from agl.store.txn import Tx
from agl.types import ResourcesUpdate

_COLUMNS = "resources_id, resources, create_time, update_time"


def _from_row(row: Mapping[str, Any]) -> ResourcesUpdate:
    return ResourcesUpdate(
        resources_id=row["resources_id"],
        resources=json.loads(row["resources"]),
        create_time=row["create_time"],
        update_time=row["update_time"],
    )


class Resources:
    def __init__(self, db: Db):
        self.db = db

    @staticmethod
    def _add_tx(tx: Tx, resources: dict[str, Any], resources_id: Optional[str]) -> ResourcesUpdate:
        version = tx.conn.execute("SELECT coalesce(max(version), 0) + 1 FROM resources").fetchone()[0]
        resources_id = resources_id or txn.new_resources_id(tx.conn, version)
        if tx.conn.execute("SELECT 1 FROM resources WHERE resources_id = ?", (resources_id,)).fetchone():
            raise ValueError(f"Resources {resources_id!r} already exist")
        tx.conn.execute(
            "INSERT INTO resources (resources_id, resources, version, create_time, update_time) VALUES (?, ?, ?, ?, ?)",
            (resources_id, dumps(resources), version, tx.now, tx.now),
        )
        return ResourcesUpdate(resources_id=resources_id, resources=resources, create_time=tx.now, update_time=tx.now)

    async def add_resources(self, resources: dict[str, Any], resources_id: Optional[str]) -> ResourcesUpdate:
        return await self.db.write(self._add_tx, dict(resources), resources_id)

    @staticmethod
    def _update_tx(tx: Tx, resources_id: str, resources: dict[str, Any]) -> ResourcesUpdate:
        row = tx.conn.execute(
            "UPDATE resources SET resources = ?, update_time = ?, "
            f"version = (SELECT max(version) + 1 FROM resources) WHERE resources_id = ? RETURNING {_COLUMNS}",
            (dumps(resources), tx.now, resources_id),
        ).fetchone()
        if row is None:
            raise ValueError(f"Resources {resources_id!r} not found")
        return _from_row(row)

    async def update_resources(self, resources_id: str, resources: dict[str, Any]) -> ResourcesUpdate:
        return await self.db.write(self._update_tx, resources_id, dict(resources))

    async def get_resources_by_id(self, resources_id: str) -> Optional[ResourcesUpdate]:
        def read(conn: Any) -> Optional[ResourcesUpdate]:
            row = conn.execute(f"SELECT {_COLUMNS} FROM resources WHERE resources_id = ?", (resources_id,)).fetchone()
            return None if row is None else _from_row(row)

        return await self.db.read(read)

    async def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        def read(conn: Any) -> Optional[ResourcesUpdate]:
            row = conn.execute(f"SELECT {_COLUMNS} FROM resources ORDER BY version DESC LIMIT 1").fetchone()
            return None if row is None else _from_row(row)

        return await self.db.read(read)
