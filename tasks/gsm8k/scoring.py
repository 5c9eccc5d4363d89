"""Answer extraction and scoring for GSM8K.

Completions are expected to end with a line ``#### N`` (the GSM8K convention).

* ``extract_strict`` reads only that line; ``extract_lenient`` falls back to the
  last number anywhere in the text.
* ``reward`` judges correctness with *strict* extraction, so the policy is only
  paid for answers in the ``#### N`` format (the reward teaches the format);
  lenient extraction is for reporting ("would it be right if we squinted?").
* Numbers are compared exactly (``decimal.Decimal`` / ``fractions.Fraction``),
  never as floats: ``"72" == "72.0" == "$72" == "72.00"`` and ``"1,000" == "1000"``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

# One number as it may appear in text: optional minus (but not the minus of a
# subtraction such as "5-3"), optional "$", digits with optional thousands
# commas, optional decimals; a leading-dot decimal such as ".5" is allowed too.
_NUMBER = r"""
    (?:(?<![\w)])-)?                  # sign, unless glued to a word/')' ("5-3")
    \$?                               # dollar sign
    (?: \d{1,3}(?:,\d{3})+(?!\d)      # 1,234,567
      | \d+                           # 1234567
      | (?=\.\d) )                    # nothing, if a ".5"-style decimal follows
    (?:\.\d+)?                        # .5
"""
_NUMBER_RE = re.compile(_NUMBER, re.VERBOSE)
# The rest of the line after "####": the number, then only whitespace/punctuation.
_FINAL_LINE_RE = re.compile(rf"[ \t]*(?P<num>{_NUMBER})[ \t.,;:!?]*(?:\n|$)", re.VERBOSE)


def normalize_number(s: str) -> str | None:
    """Canonical string for a number written ``s``, or None if ``s`` is not one number.

    Strips ``$``, thousands commas, a trailing period and trailing zeros.

    >>> normalize_number("1,234")
    '1234'
    >>> normalize_number("$72.00")
    '72'
    >>> normalize_number("-3.50")
    '-3.5'
    >>> normalize_number(".5")
    '0.5'
    >>> normalize_number("72.")
    '72'
    >>> normalize_number("1,23") is None, normalize_number("seven") is None
    (True, True)
    """
    s = s.strip()
    if s.endswith("."):
        s = s[:-1]
    if not _NUMBER_RE.fullmatch(s):
        return None
    try:
        d = Decimal(s.replace("$", "").replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the regex already guarantees a number
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def numbers_equal(a: str | None, b: str | None) -> bool:
    """True if ``a`` and ``b`` are the same number (exactly); False if either is not a number.

    >>> numbers_equal("72", "$72.00"), numbers_equal("1,000", "1000"), numbers_equal("0.1", ".10")
    (True, True, True)
    >>> numbers_equal("72", "72.01"), numbers_equal(None, "72"), numbers_equal("72", "")
    (False, False, False)
    """
    na = normalize_number(a) if a is not None else None
    nb = normalize_number(b) if b is not None else None
    if na is None or nb is None:
        return False
    return Fraction(Decimal(na)) == Fraction(Decimal(nb))


def extract_strict(text: str) -> str | None:
    """The normalized number on the ``#### N`` line (last ``####`` in ``text``), else None.

    The line must hold just the number, optionally followed by whitespace or
    punctuation; anything on later lines is ignored.

    >>> extract_strict("48 + 24 = 72\\n#### 72")
    '72'
    >>> extract_strict("So she pays $1,234.50.\\n#### $1,234.50.")
    '1234.5'
    >>> extract_strict("#### -3.0")
    '-3'
    >>> extract_strict("#### 5\\n#### 7")  # the last #### wins
    '7'
    >>> extract_strict("The answer is 72.") is None  # no #### line
    True
    >>> extract_strict("#### 72 apples") is None  # extra words: not the format
    True
    """
    idx = text.rfind("####")
    if idx < 0:
        return None
    m = _FINAL_LINE_RE.match(text, idx + 4)
    return normalize_number(m.group("num")) if m else None


def extract_lenient(text: str) -> str | None:
    """``extract_strict(text)`` if there is a ``#### N`` line, else the last number in ``text``.

    >>> extract_lenient("She has 3 apples and buys 4, so 7 in total.")
    '7'
    >>> extract_lenient("It costs $1,200.00")
    '1200'
    >>> extract_lenient("#### 12\\nor maybe 13")
    '12'
    >>> extract_lenient("5-3 leaves a change of -2.") , extract_lenient("no digits") is None
    ('-2', True)
    """
    strict = extract_strict(text)
    if strict is not None:
        return strict
    matches = _NUMBER_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def score(completion: str, gold: str, *, strict: bool = True) -> dict:
    """``{"format": a #### N line exists, "correct": the extracted answer equals gold}``.

    >>> score("24 + 48 = 72\\n#### 72", "72")
    {'format': True, 'correct': True}
    >>> score("The answer is 72.", "72"), score("The answer is 72.", "72", strict=False)
    ({'format': False, 'correct': False}, {'format': False, 'correct': True})
    """
    pred = extract_strict(completion) if strict else extract_lenient(completion)
    return {"format": extract_strict(completion) is not None, "correct": numbers_equal(pred, gold)}


def reward(completion: str, gold: str, *, format_bonus: float = 0.1) -> float:
    """1.0 if correct under strict extraction, else ``format_bonus`` if the ``#### N`` format is there, else 0.0.

    Correctness uses strict extraction on purpose, so the reward teaches the format.

    >>> reward("#### 72", "72"), reward("#### 71", "72"), reward("The answer is 72", "72")
    (1.0, 0.1, 0.0)
    """
    s = score(completion, gold, strict=True)
    if s["correct"]:
        return 1.0
    return format_bonus if s["format"] else 0.0
