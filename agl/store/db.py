"""SQLite plumbing: opening the file, installing the schema, and the one thread
that owns the connection.

Why a single dedicated thread: sqlite3 calls block (disk I/O, waiting for
another process's write lock), so they must not run on the event loop. One
worker thread per store owns the connection; every store operation is one hop
to it (`loop.run_in_executor`). That also serializes the operations of a
process, so the store needs no locks of its own; across processes, writers
serialize on SQLite's lock (`BEGIN IMMEDIATE`, waited for up to `busy_timeout`).

Durability settings (see docs/store.md for the argument):
* `journal_mode=WAL`: readers (e.g. a `report` process) never block the writer,
  and a crash leaves the database consistent (an unfinished transaction is
  simply not in the WAL).
* `synchronous=NORMAL` by default: a commit is durable once written to the WAL
  in the OS cache, so `kill -9` of the process loses nothing that was committed;
  only an OS crash or power cut may drop the last commits (never corrupting the
  file). FULL would fsync every commit, i.e. cap the store at disk-flush speed.
  `save_checkpoint` commits with a flush regardless (see runstate.py).
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, TypeVar

SCHEMA_VERSION = 2
# Version 1 differs only in its views, which are derived: installing the schema
# recreates them, and a read-only reader can use version-1 views as they are
# (their data holds no harness-ended notes, which only version-2 code writes).
UPGRADABLE_VERSIONS = (0, 1)
READABLE_VERSIONS = (1, SCHEMA_VERSION)
Synchronous = Literal["NORMAL", "FULL"]
T = TypeVar("T")


def schema_sql() -> str:
    return resources.files("agl.store").joinpath("schema.sql").read_text()


def connect(path: Path, *, readonly: bool, busy_timeout: float, synchronous: Synchronous) -> sqlite3.Connection:
    """Open the store file with the pragmas the store relies on; create it if writable."""
    if readonly:
        if not path.exists():
            raise FileNotFoundError(f"no store at {path}")
        conn = sqlite3.connect(
            f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=busy_timeout,
            isolation_level=None, check_same_thread=False,
        )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            str(path), timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
        # WAL is a property of the file; setting it needs no transaction in progress.
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise RuntimeError(f"could not switch {path} to WAL mode (got {mode!r})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        # Checkpoint blobs make big transactions; do not keep a huge WAL around after them.
        conn.execute(f"PRAGMA journal_size_limit={64 * 1024 * 1024}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA cache_size=-32000")  # 32 MB page cache: the hot indexes stay in memory
    conn.execute("PRAGMA temp_store=MEMORY")
    return conn


def install_schema(conn: sqlite3.Connection) -> None:
    """Create the tables if missing and (re)create the views, atomically: a new file
    or an upgrade of an older version (two processes may race here; both end the same)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version == SCHEMA_VERSION:
        return
    if version not in UPGRADABLE_VERSIONS:
        raise RuntimeError(f"store schema version {version} is not supported (expected {SCHEMA_VERSION})")
    schema = schema_sql()
    drop_views = "".join(f"DROP VIEW IF EXISTS {name};\n" for name in re.findall(r"CREATE VIEW IF NOT EXISTS (\w+)", schema))
    conn.executescript(
        "BEGIN IMMEDIATE;\n" + drop_views + schema + f"\nPRAGMA user_version={SCHEMA_VERSION};\nCOMMIT;"
    )


def check_schema(conn: sqlite3.Connection) -> None:
    """For read-only opens, which cannot upgrade."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version not in READABLE_VERSIONS:
        raise RuntimeError(f"store schema version {version} is not supported (expected {SCHEMA_VERSION})")


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT: take the write lock up front.

    Taking it at BEGIN (not at the first write) is what makes read-then-write
    sequences such as dequeue safe across processes: nobody can commit between
    our SELECT of the queue head and our UPDATE of it.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextmanager
def read_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """A consistent snapshot for reads made of several statements."""
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")


class Worker:
    """The single thread that owns a store's connection."""

    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._thread_ident: int | None = None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the worker thread and block for its result (setup/teardown only)."""
        if threading.get_ident() == self._thread_ident:
            return fn(*args)
        return self._executor.submit(self._tracked, fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the worker thread without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _tracked(self, fn: Callable[..., T], *args: Any) -> T:
        self._thread_ident = threading.get_ident()
        return fn(*args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
