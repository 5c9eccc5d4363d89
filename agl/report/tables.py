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


# Metrics derived from a 0/1 score by eval_during_training: its Wilson interval, the paired comparison with the
# baseline, and (a final eval after a warm-up) with the eval where RL began (``_rl_*``). Tables show them inside
# the score's own cell, not as columns.
CHANGE_SUFFIXES = ("_base", "_gained", "_lost", "_p")
RL = "_rl"  # the RL phase's own change: against the eval at the warm-up's end
DERIVED_SUFFIXES = ("_lo", "_hi", *CHANGE_SUFFIXES, *(RL + s for s in CHANGE_SUFFIXES))


def is_derived(row: dict, key: str) -> bool:
    return any(key.endswith(suffix) and key[: -len(suffix)] in row for suffix in DERIVED_SUFFIXES)


def paired_scores(row: dict) -> list[str]:
    """The 0/1 scores of ``row`` that carry a paired comparison with the baseline (``<score>_p`` and the rest).

    >>> paired_scores({"eval/a": 0.5, "eval/a_gained": 2, "eval/a_p": 0.5, "eval/a_rl_p": 1.0, "eval/b": 0.1})
    ['eval/a']
    """
    return sorted(k[:-2] for k in row if k.endswith("_p") and k[:-2] in row and f"{k[:-2]}_gained" in row)


def with_interval(row: dict, key: str) -> Any:
    """``row[key]``, as "rate [lo, hi]" when its interval is in the row too.

    >>> with_interval({"eval/correct": 0.05, "eval/correct_lo": 0.0215, "eval/correct_hi": 0.1118}, "eval/correct")
    '0.05 [0.0215, 0.1118]'
    """
    value = row.get(key)
    if value is None or f"{key}_lo" not in row:
        return value
    return f"{fmt(value)} [{fmt(row[key + '_lo'])}, {fmt(row[key + '_hi'])}]"


def vs_base(row: dict, key: str, since: str = "") -> str | None:
    """The paired comparison with the baseline in ``row``, e.g. "0.01 -> 0.05 (+6 -2, p=0.29)"; ``since=RL``: with
    the eval where RL began (the warm-up's end) instead."""
    if f"{key}{since}_p" not in row:
        return None
    return f"{fmt(row[key + since + '_base'])} -> {fmt(row[key])} ({change(row, key + since)})"


def change(row: dict, prefix: str) -> str:
    """``"+6 -2, p=0.29"``: the tasks gained and lost and McNemar's p, from ``<prefix>_gained``, ``_lost``, ``_p``.

    >>> change({"eval/a_gained": 6.0, "eval/a_lost": 2.0, "eval/a_p": 0.2891}, "eval/a")
    '+6 -2, p=0.2891'
    """
    return f"+{int(row[prefix + '_gained'])} -{int(row[prefix + '_lost'])}, p={fmt(row[prefix + '_p'])}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats shortened by ``fmt``."""
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in cells)])
