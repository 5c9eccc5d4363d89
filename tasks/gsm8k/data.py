"""Load the GSM8K splits shipped in ``tasks/gsm8k/data`` (MIT licence beside them).

Each row is ``{"id", "question", "answer", "gold"}`` where ``answer`` is the full
gold solution (with ``<<48/2=24>>`` calculator annotations and a final
``#### 72`` line) and ``gold`` is the number after ``####`` with commas removed.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
SPLITS = ("train", "test")

_CALC_ANNOTATION = re.compile(r"<<[^<>]*>>")


@functools.cache
def load_split(split: str) -> list[dict]:
    """Return all rows of ``split`` ("train" or "test"), cached per process.

    The returned list is shared between callers: treat it as read-only.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown GSM8K split {split!r}; valid splits: {', '.join(SPLITS)}")
    rows = []
    with open(DATA_DIR / f"{split}.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            raw = json.loads(line)
            answer = raw["answer"]
            gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
            rows.append({"id": f"{split}-{i}", "question": raw["question"], "answer": answer, "gold": gold})
    return rows


def solution_text(row: dict) -> str:
    """The gold solution as a clean demonstration (for SFT).

    Strips the ``<<...>>`` calculator annotations and keeps the final ``#### N`` line.

    >>> solution_text({"answer": "Half is 48/2 = <<48/2=24>>24.\\n#### 24"})
    'Half is 48/2 = 24.\\n#### 24'
    """
    return _CALC_ANNOTATION.sub("", row["answer"]).strip()
