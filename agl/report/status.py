"""``status.json``: what a run dir says of its job, ``running`` / ``succeeded`` / ``failed`` (with the error;
the traceback is in ``error.log``), written atomically by ``agl.jobs.dispatch`` and read by reports and
sweep summaries. ``effective_status`` tells a ``running`` whose process is gone (killed) as ``unfinished``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from agl.errors import disk_full_named

STATUS_FILE = "status.json"


# ----------------------------------------------------------------------------- status files


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_status(run_dir: Path, status: str, **fields: Any) -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {**(read_status(run_dir) or {}), "status": status, "updated": time.time(), **fields}
    tmp = run_dir / f".{STATUS_FILE}.tmp"
    with disk_full_named(run_dir / STATUS_FILE):
        tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
        os.replace(tmp, run_dir / STATUS_FILE)  # never a half-written status
    return record


def effective_status(record: dict | None) -> str:
    """``running`` when the recorded process is gone becomes ``unfinished`` (killed)."""
    if not record:
        return "unknown"
    status = record.get("status", "unknown")
    if status == "running":
        import psutil

        pid = record.get("pid")
        if not (pid and psutil.pid_exists(pid)) or record.get("host") not in (None, os.uname().nodename):
            return "unfinished"
    return status
