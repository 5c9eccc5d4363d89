"""The run's store: one SQLite file per run (`<run dir>/store.sqlite`).

`SqliteStore` is the LightningStore of the harness (agent-lightning v0.2 names
and semantics). Status rules: `agl/store/rules.py` (also `charged_attempt_number`
and `is_harness_ended`, for code that must not count harness crashes as tries).
Schema and views: `agl/store/schema.sql`. Guide and example queries: docs/store.md.
Served over HTTP: `agl.store.server.StoreServer` (`python harness.py algo=store`), and its clients
`StoreClient` (async) and `SyncStoreClient` (client.py), with the same methods.
"""

from agl.store.client import StoreClient, StoreUnreachable, SyncStoreClient
from agl.store.db import StoreDamaged
from agl.store.rules import charged_attempt_number, is_harness_ended
from agl.store.sessions import SessionEnded
from agl.store.store import ReadOnlyStoreError, SqliteStore

__all__ = [
    "SqliteStore",
    "StoreClient",
    "SyncStoreClient",
    "ReadOnlyStoreError",
    "StoreDamaged",
    "SessionEnded",
    "StoreUnreachable",
    "charged_attempt_number",
    "is_harness_ended",
]
