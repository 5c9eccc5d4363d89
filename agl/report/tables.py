"""Markdown tables and number formatting for eval tables, reports and sweep summaries.

Nothing here imports torch or the store: ``report=`` and sweep summaries format their tables
without loading a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return (
            f"{value:.{digits}g}"
            if abs(value) >= 1e4 or (value and abs(value) < 1e-3)
            else f"{value:.{digits}f}".rstrip("0").rstrip(".") or "0"
        )
    return "" if value is None else str(value)


# Metrics derived from a 0/1 score by eval_during_training: its Wilson interval, and the paired
# comparison with the baseline. Tables show them inside the score's own cell, not as columns.
DERIVED_SUFFIXES = ("_lo", "_hi", "_base", "_gained", "_lost", "_p")


def is_derived(row: dict, key: str) -> bool:
    return any(key.endswith(suffix) and key[: -len(suffix)] in row for suffix in DERIVED_SUFFIXES)


def with_interval(row: dict, key: str) -> Any:
    """``row[key]``, as "rate [lo, hi]" when its interval is in the row too.

    >>> with_interval({"eval/correct": 0.05, "eval/correct_lo": 0.0215, "eval/correct_hi": 0.1118}, "eval/correct")
    '0.05 [0.0215, 0.1118]'
    """
    value = row.get(key)
    if value is None or f"{key}_lo" not in row:
        return value
    return f"{fmt(value)} [{fmt(row[key + '_lo'])}, {fmt(row[key + '_hi'])}]"


def vs_base(row: dict, key: str) -> str | None:
    """The paired comparison with the baseline in ``row``, e.g. "0.01 -> 0.05 (+6 -2, p=0.29)"."""
    if f"{key}_p" not in row:
        return None
    return (
        f"{fmt(row[key + '_base'])} -> {fmt(row[key])} (+{int(row[key + '_gained'])} -{int(row[key + '_lost'])}, "
        f"p={fmt(row[key + '_p'])})"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats shortened by ``fmt``."""
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in cells)])
