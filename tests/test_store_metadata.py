"""`query_rollouts(metadata=...)`: the rollouts an evaluation tagged, found through an index;
and files written before those indexes existed (read as they are, upgraded by a writer)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from agl.store import SqliteStore, db
from agl.store.db import missing_indexes, schema_sql

asyncio_test = pytest.mark.asyncio

TAG_INDEXES = ["rollouts_eval_step", "rollouts_eval", "rollouts_candidate"]
METADATA = [
    {"eval_step": 0, "task_id": "a"},
    {"eval_step": 0, "task_id": "b", "try": 1},
    {"eval_step": 3, "task_id": "a"},
    {"eval": "eval", "task_id": "a"},
    {"candidate": "cot", "task_id": "a", "flag": True},
    {"candidate": "cot", "task_id": None, "nested": {"x": [1, 2]}},
    {"step": 2, "eval_step": "0"},  # a string, not the number 0
    {"eval_step": 0.0, "task_id": "c"},  # JSON 0.0 == 0, as in Python
    {},
]
QUERIES = [
    {"eval_step": 0},
    {"eval_step": 3},
    {"eval_step": "0"},
    {"eval": "eval"},
    {"candidate": "cot"},
    {"candidate": "cot", "task_id": None},  # None: a null or missing key
    {"flag": True},
    {"flag": 1},  # True == 1 in Python and in SQL
    {"nested": {"x": [1, 2]}},  # not decidable in SQL: compared in Python
    {"task id": None},  # not a plain key: compared in Python
    {"eval_step": 0, "task_id": "b"},
    {"step": 2},
    {"eval_step": 7},
    {},
]


def expected(query: dict, ids: list[str]) -> list[str]:
    """The old `agl.eval.evaluate._matches` filter over all rollouts: the semantics to keep."""
    return [rid for rid, meta in zip(ids, METADATA) if all(meta.get(k) == v for k, v in query.items())]


def plan_of_metadata_query(store: SqliteStore, query: dict) -> str:
    """EXPLAIN QUERY PLAN of the statement the store runs for `query_rollouts(metadata=query)`."""
    statements: list[str] = []
    conn = store._db.conn
    conn.set_trace_callback(statements.append)
    try:
        store._worker.call(store._db.read_sync, store._query_rollouts, None, None, None, query)
    finally:
        conn.set_trace_callback(None)
    [sql] = [s for s in statements if s.startswith("SELECT") and "FROM rollouts" in s]
    return " ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql))


@asyncio_test
async def test_metadata_query_matches_pythons_equality_in_creation_order(store: SqliteStore):
    rollouts = await store.enqueue_rollouts(list(range(len(METADATA))), metadata=METADATA)
    ids = [r.rollout_id for r in rollouts]
    for query in QUERIES:
        found = await store.query_rollouts(metadata=query)
        assert [r.rollout_id for r in found] == expected(query, ids), query
    await store.dequeue_rollout()
    assert [r.rollout_id for r in await store.query_rollouts("queuing", metadata={"eval_step": 0})] == ids[1:2] + ids[
        7:8
    ]
    assert [r.rollout_id for r in await store.query_rollouts(step=2, metadata={"eval_step": "0"})] == ids[6:7]
    assert await store.query_rollouts(rollout_ids=ids[:1], metadata={"eval_step": 3}) == []


@asyncio_test
async def test_the_evaluations_tags_are_index_probes(local_store: SqliteStore):
    store = local_store  # the plan of the local store's own statements (the client's are the server's)
    await store.enqueue_rollouts(list(range(len(METADATA))), metadata=METADATA)
    for key, value in (("eval_step", 3), ("eval", "eval"), ("candidate", "cot")):
        assert f"USING INDEX rollouts_{key}" in plan_of_metadata_query(store, {key: value})
    assert "USING INDEX rollouts_step" in plan_of_metadata_query(store, {"step": 2})
    assert "USING INDEX rollouts_eval_step" in plan_of_metadata_query(store, {"eval_step": 0, "task_id": "a"})


def drop_tag_indexes(path: Path) -> None:
    """Make the file what code before the tag indexes left: the same version, without them."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("".join(f"DROP INDEX {name};" for name in TAG_INDEXES))
    conn.close()


def file_indexes(path: Path) -> tuple[int, list[str]]:
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        return version, missing_indexes(conn, schema_sql())
    finally:
        conn.close()


@asyncio_test
async def test_a_file_without_the_tag_indexes_is_read_as_it_is_and_gains_them_on_a_writable_open(path: Path):
    store = SqliteStore(path, watchdog_interval=None)
    ids = [r.rollout_id for r in await store.enqueue_rollouts(list(range(len(METADATA))), metadata=METADATA)]
    await store.close()
    drop_tag_indexes(path)
    assert file_indexes(path) == (db.SCHEMA_VERSION, TAG_INDEXES)

    reader = SqliteStore.open_readonly(path)
    try:
        for query in QUERIES:
            assert [r.rollout_id for r in await reader.query_rollouts(metadata=query)] == expected(query, ids), query
    finally:
        await reader.close()
    assert file_indexes(path) == (db.SCHEMA_VERSION, TAG_INDEXES)  # a reader changes nothing

    writer = SqliteStore(path, watchdog_interval=None)
    try:
        assert file_indexes(path) == (db.SCHEMA_VERSION, [])  # built from the rows already there
        assert "USING INDEX rollouts_eval_step" in plan_of_metadata_query(writer, {"eval_step": 0})
        for query in QUERIES:
            assert [r.rollout_id for r in await writer.query_rollouts(metadata=query)] == expected(query, ids), query
    finally:
        await writer.close()
