"""Answer extraction and scoring for GSM8K.

A completion is *well formed* when it reasons first and ends with its answer: exactly one
``####`` in the whole text, on its last non-blank line, which holds just ``#### N``
(optionally followed by punctuation), after at least ``MIN_REASONING_CHARS`` non-space
characters of reasoning. Only a well-formed completion earns the format bonus or is graded
correct. This is what makes the reward hard to game: an earlier version read the last
``####`` and ignored what followed, and the policy learned to write ``#### <guess>`` first
and ramble after it, collecting the format bonus without learning to solve anything.

* ``extract_strict`` returns the answer of a well-formed completion, else None;
  ``extract_lenient`` falls back to the last number anywhere (for reporting only).
* ``reward`` judges correctness with *strict* extraction, so the policy is only paid for
  answers in that form; lenient extraction asks "would it be right if we squinted?".
* ``answer_not_last`` flags completions with a ``####`` line that is not their last line
  (the reward-hacking signature; reported as a metric).
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
# The answer line: "####", the number, then only whitespace/punctuation.
_ANSWER_LINE_RE = re.compile(rf"\#\#\#\#[ \t]*(?P<num>{_NUMBER})[ \t.,;:!?]*", re.VERBOSE)
# Every GSM8K gold solution has at least 31 non-space characters before its answer line.
MIN_REASONING_CHARS = 20


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


def _last_line_start(text: str) -> int:
    """Index where the last non-blank line of ``text`` starts."""
    return text.rstrip().rfind("\n") + 1


def extract_strict(text: str) -> str | None:
    """The normalized answer of a well-formed completion (see the module docstring), else None.

    >>> extract_strict("Half of 48 is 24, and 48 + 24 = 72.\\n#### 72")
    '72'
    >>> extract_strict("So she pays 1234.50 dollars in total.\\n#### $1,234.50.\\n\\n")
    '1234.5'
    >>> extract_strict("#### 72") is None  # no reasoning before it
    True
    >>> extract_strict("#### 2\\n\\nJan's total package is 25 feet long, so...") is None  # answer first
    True
    >>> extract_strict("First guess:\\n#### 5\\nNo, recomputing: 3 + 4 = 7.\\n#### 7") is None  # two answers
    True
    >>> extract_strict("Adding them up gives 72 apples.\\n#### 72 apples") is None  # words after the number
    True
    """
    if text.count("####") != 1:
        return None
    start = _last_line_start(text)
    reasoning, line = text[:start], text[start:].strip()
    match = _ANSWER_LINE_RE.fullmatch(line)
    if match is None or len("".join(reasoning.split())) < MIN_REASONING_CHARS:
        return None
    return normalize_number(match.group("num"))


def answer_not_last(text: str) -> bool:
    """Whether a ``####`` appears anywhere but on the last non-blank line.

    >>> answer_not_last("#### 2\\n\\nJan's total is 25 feet"), answer_not_last("So 3 + 4 = 7.\\n#### 7")
    (True, False)
    >>> answer_not_last("no answer line at all")
    False
    """
    index = text.find("####")
    return index >= 0 and index < _last_line_start(text)


def extract_lenient(text: str) -> str | None:
    """``extract_strict(text)`` if the completion is well formed, else the last number in ``text``.

    >>> extract_lenient("She has 3 apples and buys 4, so 7 in total.")
    '7'
    >>> extract_lenient("It costs $1,200.00")
    '1200'
    >>> extract_lenient("#### 12\\nor maybe 13")  # not well formed: the last number
    '13'
    >>> extract_lenient("5-3 leaves a change of -2.") , extract_lenient("no digits") is None
    ('-2', True)
    """
    strict = extract_strict(text)
    if strict is not None:
        return strict
    matches = _NUMBER_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def score(completion: str, gold: str, *, strict: bool = True) -> dict:
    """``{"format": the completion is well formed, "correct": the extracted answer equals gold}``.

    >>> score("Half of 48 is 24; 24 + 48 = 72.\\n#### 72", "72")
    {'format': True, 'correct': True}
    >>> score("The answer is 72.", "72"), score("The answer is 72.", "72", strict=False)
    ({'format': False, 'correct': False}, {'format': False, 'correct': True})
    """
    pred = extract_strict(completion) if strict else extract_lenient(completion)
    return {"format": extract_strict(completion) is not None, "correct": numbers_equal(pred, gold)}


def reward(completion: str, gold: str, *, format_bonus: float = 0.1) -> float:
    """1.0 if correct under strict extraction, else ``format_bonus`` if well formed, else 0.0.

    Correctness uses strict extraction on purpose, so the reward teaches the format.

    >>> why = "Half of 48 is 24, and 48 + 24 makes"
    >>> reward(why + "\\n#### 72", "72"), reward(why + "\\n#### 71", "72"), reward("#### 72", "72")
    (1.0, 0.1, 0.0)
    """
    s = score(completion, gold, strict=True)
    if s["correct"]:
        return 1.0
    return format_bonus if s["format"] else 0.0
