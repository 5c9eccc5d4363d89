"""GSM8K grade-school math: data loading and answer scoring."""

from tasks.gsm8k.data import load_split, solution_text
from tasks.gsm8k.scoring import (
    extract_lenient,
    extract_strict,
    normalize_number,
    numbers_equal,
    reward,
    score,
)

__all__ = [
    "load_split",
    "solution_text",
    "extract_strict",
    "extract_lenient",
    "normalize_number",
    "numbers_equal",
    "score",
    "reward",
]
