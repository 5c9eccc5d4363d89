"""Errors that carry a message meant for the user, printed by the harness without a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class ConfigError(Exception):
    """A setting or input the user can fix: the message says what is wrong and how to fix it."""


class DiskFull(ConfigError):
    """A write failed for want of space (ENOSPC; SQLite's SQLITE_FULL), told as one line naming the path that
    was written and the space left there. The job stops at the first one: nothing written after it could be
    trusted to be whole, and a store write that failed committed nothing (its transaction rolled back)."""

    def __init__(self, path: str | os.PathLike | None, run_dir: str | os.PathLike | None = None):
        self.path, self.run_dir = path, run_dir
        then = f"python harness.py resume={run_dir}" if run_dir is not None else "resume the run"
        super().__init__(
            f"no space left on the device holding {path} ({free_space(path)} free): the job stopped, its store "
            f"and last checkpoint intact; free some space, then {then}"
        )


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def free_space(path: str | os.PathLike | None) -> str:
    """What is free on the filesystem of ``path`` (or of its nearest existing parent), as people read it."""
    where = Path(path) if path is not None else Path.cwd()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return "unknown"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit}"
    return f"{free} bytes"


def disk_full_in(error: BaseException) -> DiskFull | None:
    """The ``DiskFull`` an exception is or was caused by (an ENOSPC ``OSError`` becomes one), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DiskFull):
            return error
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return DiskFull(error.filename)
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def disk_full_named(path: str | os.PathLike) -> Iterator[None]:
    """Writes to ``path`` in the block: an ENOSPC becomes ``DiskFull(path)``."""
    try:
        yield
    except OSError as error:
        if error.errno in NO_SPACE:
            raise DiskFull(path) from None
        raise
