"""One job per run dir: an OS-level lock held for the job's life.

Two ``harness.py`` processes on one run dir (a ``resume=`` started beside the live job, the same sweep
launched twice) would both train it: both write checkpoints and ``metrics.jsonl``. A job therefore
holds ``fcntl.flock`` on ``<run dir>/job.lock`` from before it reads ``status.json`` until it ends. The
kernel releases the lock when the process dies, however it dies (``kill -9`` included), so a lock
left by a killed job is never stale: the next job simply gets it. What the file holds (the holder's
pid, host and start time) is only for the message of a job that is refused.

The lock is not inherited: Python opens it non-inheritable, so runner processes the job starts do not
keep it alive after the job dies.

Left out: run dirs on network filesystems, where ``flock`` may lock only on one host (NFS emulates it
with POSIX locks; a second host could still get it). Jobs on one machine are what agl runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from agl.errors import disk_full_named

LOCK_FILE = "job.lock"


class RunDirBusy(Exception):
    """The run dir is held by another live job; ``holder`` is what that job wrote (pid, host, started)."""

    def __init__(self, run_dir: Path, holder: dict):
        self.run_dir, self.holder = run_dir, holder
        pid = holder.get("pid", "unknown")
        super().__init__(f"{run_dir} is held by a live job (pid {pid}: {holder.get('command', '?')})")


@contextlib.contextmanager
def holding_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s job lock for the ``with`` block. Raises ``RunDirBusy`` at once if a live process holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise RunDirBusy(run_dir, _read(fd)) from None
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300],
        }
        with disk_full_named(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock (the kernel would, too, if the process died first)


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:  # written by a job that died mid-write: only the message is poorer for it
        return {}
