"""SQLite plumbing: opening the file, installing the schema, the one thread that
owns the connection, and `Db`, through which every part of the store reads and
writes (store.py: rollouts, attempts, spans; watch.py; resources.py; runstate.py).

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

Rows come back as `sqlite3.Row`: read by column name, never by position.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import re
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, TypeVar

import agl.store.sessions as sessions
import agl.store.txn as txn
from agl.errors import ConfigError, DiskFull
from agl.store.overdue import NOTHING_OVERDUE, OverdueView
from agl.types import Attempt

SCHEMA_VERSION = 2
# The version counts changes of the tables only. Views and indexes are derived:
# a writable open (re)creates what a file lacks, so an older file gains a new index
# (built from its rows) without an upgrade step, and older code still reads a file
# that has it. Version 1 differs only in its views: installing the schema recreates
# them, and a read-only reader can use version-1 views as they are (their data
# holds no harness-ended notes, which only version-2 code writes).
UPGRADABLE_VERSIONS = (0, 1)
READABLE_VERSIONS = (1, SCHEMA_VERSION)
# Nullable columns added since version 2 that older code never reads (it names the columns it reads): a
# writable open adds what a file lacks, as it does indexes, and a file with them is still version 2. Code
# that reads them runs on writable stores only.
ADDED_COLUMNS = (("sessions", "heartbeat_seconds", "REAL"), ("sessions", "heartbeat_time", "REAL"))
Synchronous = Literal["NORMAL", "FULL"]
T = TypeVar("T")


SQLITE_HEADER = b"SQLite format 3\x00"
DAMAGE_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB (primary result codes)
FULL_CODE = 13  # SQLITE_FULL: the disk (or a quota) is full; the failed transaction was rolled back


class StoreDamaged(ConfigError):
    """The store file is damaged (truncated, overwritten, not SQLite). One line, naming the file and what
    to do; agl never writes over it (a new store there would silently start the run over)."""

    def __init__(self, path: Path, what: str):
        super().__init__(
            f"{path} is damaged ({what}); agl does not write over it: restore it from a copy, or move it "
            f"aside (mv {path} {path}.damaged) and run again to start over"
        )


def is_damage(error: sqlite3.DatabaseError) -> bool:
    return (getattr(error, "sqlite_errorcode", 0) or 0) & 0xFF in DAMAGE_CODES


def is_full(error: sqlite3.DatabaseError) -> bool:
    return (getattr(error, "sqlite_errorcode", 0) or 0) & 0xFF == FULL_CODE


def check_file(path: Path) -> None:
    """Refuse a store file that is visibly damaged before SQLite opens it: a header that is not SQLite's,
    or a file shorter than its header says with no WAL file to hold the rest (truncated). An empty file is
    a new store, as SQLite has it. Damage inside the pages is found when they are read (``Db``)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(SQLITE_HEADER):
        raise StoreDamaged(path, "not an SQLite database: its header is gone")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    counted = header[24:28] == header[92:96]  # the header's page count is valid (SQLite's own rule)
    wal = path.with_name(path.name + "-wal")
    if counted and size < pages * page_size and not (wal.exists() and wal.stat().st_size > 0):
        raise StoreDamaged(path, f"truncated: {size} bytes of the {pages * page_size} its header counts")


def schema_sql() -> str:
    return resources.files("agl.store").joinpath("schema.sql").read_text()


def connect(path: Path, *, readonly: bool, busy_timeout: float, synchronous: Synchronous) -> sqlite3.Connection:
    """Open the store file with the pragmas the store relies on; create it if writable. A damaged file is
    ``StoreDamaged``, found before SQLite opens it (``check_file``) or by the first pragma that reads it."""
    check_file(path)
    try:
        return _connect(path, readonly=readonly, busy_timeout=busy_timeout, synchronous=synchronous)
    except sqlite3.DatabaseError as error:
        if is_damage(error):
            raise StoreDamaged(path, str(error)) from None
        raise


def _connect(path: Path, *, readonly: bool, busy_timeout: float, synchronous: Synchronous) -> sqlite3.Connection:
    if readonly:
        if not path.exists():
            raise FileNotFoundError(f"no store at {path}")
        conn = sqlite3.connect(
            f"{path.resolve().as_uri()}?mode=ro",
            uri=True,
            timeout=busy_timeout,
            isolation_level=None,
            check_same_thread=False,
        )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=busy_timeout, isolation_level=None, check_same_thread=False)
        # WAL is a property of the file; setting it needs no transaction in progress.
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise RuntimeError(f"could not switch {path} to WAL mode (got {mode!r})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        # Checkpoint blobs make big transactions; do not keep a huge WAL around after them.
        conn.execute(f"PRAGMA journal_size_limit={64 * 1024 * 1024}")
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA cache_size=-32000")  # 32 MB page cache: the hot indexes stay in memory
    conn.execute("PRAGMA temp_store=MEMORY")
    return conn


def install_schema(conn: sqlite3.Connection) -> None:
    """Create the tables and indexes if missing and (re)create the views, atomically: a
    new file, an upgrade of an older version, or a current file that lacks an index
    added since it was written (two processes may race here; both end the same)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    schema = schema_sql()
    if version == SCHEMA_VERSION:
        if not missing_indexes(conn, schema) and not missing_columns(conn):
            return
        with write_transaction(conn):  # IF NOT EXISTS: only the missing; a racing process may have added them
            add_missing_columns(conn)
            for statement in _statements(schema):
                conn.execute(statement)
        return
    if version not in UPGRADABLE_VERSIONS:
        raise RuntimeError(f"store schema version {version} is not supported (expected {SCHEMA_VERSION})")
    drop_views = "".join(
        f"DROP VIEW IF EXISTS {name};\n" for name in re.findall(r"CREATE VIEW IF NOT EXISTS (\w+)", schema)
    )
    with write_transaction(conn):
        add_missing_columns(conn)  # before the schema: its indexes and views may name them
        for statement in _statements(drop_views + schema + f"\nPRAGMA user_version={SCHEMA_VERSION};"):
            conn.execute(statement)


def _statements(script: str) -> list[str]:
    """A script's statements, one by one (``executescript`` would commit the transaction around them)."""
    statements, pending = [], ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending)
            pending = ""
    return statements


def missing_columns(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
    """The ``ADDED_COLUMNS`` the file's tables lack (none of a table the file does not have yet)."""
    missing = []
    for table, column, decl in ADDED_COLUMNS:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if have and column not in have:
            missing.append((table, column, decl))
    return missing


def add_missing_columns(conn: sqlite3.Connection) -> None:
    for table, column, decl in missing_columns(conn):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def missing_indexes(conn: sqlite3.Connection, schema: str) -> list[str]:
    """The schema's indexes the file does not have (yet)."""
    have = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    return [name for name in re.findall(r"CREATE INDEX IF NOT EXISTS (\w+)", schema) if name not in have]


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
        """Run `fn` on the worker thread without blocking the event loop, in the caller's context (the
        session a store server acts for is a context variable: `acting_session`)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def _tracked(self, fn: Callable[..., T], *args: Any) -> T:
        self._thread_ident = threading.get_ident()
        return fn(*args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


# -- building statements -------------------------------------------------------


class Where:
    """Optional filters of a query, ANDed: `str(where)` is "" or " WHERE ...", `where.params`
    their parameters in order."""

    __slots__ = ("clauses", "params")

    def __init__(self) -> None:
        self.clauses: list[str] = []
        self.params: list[Any] = []

    def add(self, clause: str, *params: Any) -> None:
        self.clauses.append(clause)
        self.params.extend(params)

    def __str__(self) -> str:
        return " WHERE " + " AND ".join(self.clauses) if self.clauses else ""


def update(
    conn: sqlite3.Connection, table: str, values: Mapping[str, Any], key: tuple[str, Any], returning: str = ""
) -> Optional[sqlite3.Row]:
    """`UPDATE table SET <each of values> WHERE <key column> = ?`: the one place a SET clause
    is built from the fields a caller gives. Column names come from code, never from data.
    Returns the RETURNING row (None without `returning`, or if no row matched); nothing
    to set is a no-op."""
    if not values:
        return None
    column, value = key
    sql = f"UPDATE {table} SET {', '.join(f'{name} = ?' for name in values)} WHERE {column} = ?"
    if returning:
        sql += f" RETURNING {returning}"
    return conn.execute(sql, (*values.values(), value)).fetchone()


# -- the store's access to its file --------------------------------------------


acting_session: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("agl_store_session", default=None)
"""The store session a write is made for, when it is not the store's own: a store server sets it per request
to its client's session (agl/store/server.py), so the attempts a client creates are its own (R7)."""


class ReadOnlyStoreError(RuntimeError):
    """A write was attempted on a store opened with `readonly=True`."""


class Db:
    """The store's file as every part of the store uses it: the connection, owned by one
    worker thread, and one hop to that thread per operation.

    * `write(fn, *args)` runs `fn(tx, *args)` in one `BEGIN IMMEDIATE` transaction; after
      COMMIT (never before) the rollouts it made terminal go to `on_commit`, which wakes
      their waiters (watch.py).
    * `read(fn, *args)` runs `fn(conn, *args)` in one snapshot, after applying due
      deadlines if the store is writable (R6), so no read shows an overdue attempt as
      active; a read-only store shows R6 in memory instead (`overdue_view`).
    """

    def __init__(
        self,
        path: Path,
        *,
        readonly: bool,
        clock: Callable[[], float],
        busy_timeout: float,
        synchronous: Synchronous,
        on_commit: Callable[[Iterable[str]], None],
    ):
        self.path = path
        self.readonly = readonly
        self.clock = clock
        self.busy_timeout = busy_timeout
        self.synchronous = synchronous
        self.on_commit = on_commit
        self.conn: Any = None
        self.session_id: Optional[str] = None  # set once the store's session is registered
        self.closed = False
        self.full = False  # a write found the disk full: every later operation says so (DiskFull)
        self.worker = Worker("agl-store")

    def connect(self) -> None:
        """Open the file, with its schema installed (writable) or checked (read-only)."""
        with self.damage_named():
            self.conn = connect(
                self.path, readonly=self.readonly, busy_timeout=self.busy_timeout, synchronous=self.synchronous
            )
            if self.readonly:
                check_schema(self.conn)
            else:
                install_schema(self.conn)

    @contextmanager
    def damage_named(self) -> Iterator[None]:
        """SQLite's word for a damaged file (``database disk image is malformed``, ``file is not a database``),
        from wherever it is found, as ``StoreDamaged``: one line naming the file. A full disk (``SQLITE_FULL``)
        is ``DiskFull``, and it sticks: from then on every operation raises it without touching the file, so
        nothing that followed a lost write (an attempt failed because its span could not be stored) commits
        once a little space turns up. The job stops; a resume starts from what did commit."""
        try:
            yield
        except sqlite3.DatabaseError as error:
            if is_damage(error):
                raise StoreDamaged(self.path, str(error)) from None
            if is_full(error):
                self.full = True
                raise DiskFull(self.path) from None
            raise

    def close_connection(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"store {self.path} is closed")
        if self.full:
            raise DiskFull(self.path)

    def check_writable(self) -> None:
        self.check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only")

    async def run(self, fn: Callable[..., T], *args: Any, writes: bool = False) -> T:
        """Run `fn(*args)` on the worker thread as it is (it makes its own transactions)."""
        if writes:
            self.check_writable()
        else:
            self.check_open()
        with self.damage_named():
            return await self.worker.run(fn, *args)

    def write_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(tx, *args)` in one write transaction, for the acting session (`acting_session`, else the
        store's own); a client's write is refused, whole, once its session has ended (`SessionEnded`)."""
        return self._write_sync(acting_session.get(), fn, *args)

    def maintain_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """A write of the store's own upkeep (deadlines, ended sessions), whoever's request it runs in."""
        return self._write_sync(None, fn, *args)

    def _write_sync(self, acting: Optional[str], fn: Callable[..., T], *args: Any) -> T:
        tx = txn.Tx(self.conn, self.clock(), acting or self.session_id)
        with write_transaction(self.conn):
            if acting is not None:
                sessions.require_open(self.conn, acting)
            result = fn(tx, *args)
        if tx.finished:
            self.on_commit(tx.finished)
        return result

    def durable_write_sync(self, fn: Callable[..., T], *args: Any) -> T:
        # synchronous=FULL for this one COMMIT: it is fsynced (with all before it).
        self.conn.execute("PRAGMA synchronous=FULL")
        try:
            return self.write_sync(fn, *args)
        finally:
            self.conn.execute(f"PRAGMA synchronous={self.synchronous}")

    async def write(self, fn: Callable[..., T], *args: Any, durable: bool = False) -> T:
        """Run `fn(tx, *args)` in one write transaction on the worker thread;
        `durable=True` flushes its commit to disk whatever `synchronous` is."""
        self.check_writable()
        with self.damage_named():
            return await self.worker.run(self.durable_write_sync if durable else self.write_sync, fn, *args)

    def read_sync(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.readonly:
            self.expire_due()
        with read_transaction(self.conn):
            return fn(self.conn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` in one read transaction (a consistent snapshot)."""
        self.check_open()
        with self.damage_named():
            return await self.worker.run(self.read_sync, fn, *args)

    def expire_due(self) -> list[Attempt]:
        """R6 now: one probe of the deadline index when nothing is due."""
        if not txn.has_due_deadline(self.conn, self.clock()):
            return []
        return self.maintain_sync(txn.expire_due_attempts)

    def overdue_view(self, conn: sqlite3.Connection, rollout_ids: Optional[Iterable[str]] = None) -> OverdueView:
        """How reads must show overdue attempts (and the rollouts `rollout_ids`, None: all):
        a writable store has expired them already, a read-only one shows R6 in memory."""
        if not self.readonly:
            return NOTHING_OVERDUE
        return OverdueView.at(conn, self.clock(), None if rollout_ids is None else list(rollout_ids))
