"""The run's store: one SQLite file per run (`<run dir>/store.sqlite`).

`SqliteStore` is the LightningStore of the harness (agent-lightning v0.2 names
and semantics). Status rules: `agl/store/rules.py` (also `charged_attempt_number`
and `is_harness_ended`, for code that must not count harness crashes as tries).
Schema and views: `agl/store/schema.sql`. Guide and example queries: docs/store.md.
"""

from agl.store.db import StoreDamaged
from agl.store.rules import charged_attempt_number, is_harness_ended
from agl.store.store import ReadOnlyStoreError, SqliteStore

__all__ = ["SqliteStore", "ReadOnlyStoreError", "StoreDamaged", "charged_attempt_number", "is_harness_ended"]
