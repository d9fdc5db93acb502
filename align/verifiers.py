"""Built-in verifiable rewards, stdlib only. Each is ``fn(prompt, completion, answer=None, **fields) -> float`` and
reads the row's ``answer`` column, or its ``solution`` column when it has no ``answer`` (``--answer-key`` names
another); a reference answer that is a worked solution gives its final answer: GSM8K's ``#### 72`` line, else its
last ``\\boxed{...}`` (use as ``--reward align.verifiers:boxed_match``; ``align.rewards:boxed_match`` names the same
function):

- ``exact_match``: the completion, stripped, equals the answer;
- ``boxed_match``: the last ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces allowed) equals the answer;
- ``last_number_match``: the completion's final answer (a ``#### N`` line or the last ``\\boxed{}``, as GSM8K and
  MATH write it), else its last number (signs, ``1,234`` thousands separators, decimals, ``a/b`` fractions), equals
  the answer, compared exactly as fractions;
- ``think_answer_format``: ``<think>...</think>`` then an answer (a format reward: no ``answer`` needed).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces balanced; None if none closes."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


_NUMBER = re.compile(
    r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*[-+]?\d+(?:\.\d+)?)?|"
    r"(?<![\w.])[-+−]?\.\d+"
)


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number: ``-1,234.50``, ``+3``, ``.5``, ``3/4``, ``\\frac{3}{4}``, ``-\\dfrac{1}{2}``,
    ``$42$``, ``42.``, ``50%`` is not a number here (None). None if ``text`` is not one number."""
    s = text.strip().strip("$").strip()
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("−", "-")
    if re.search(r"\d\s+\d", s):  # "4 5" is two numbers, not 45
        return None
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    m = re.fullmatch(r"([-+]?)\(?([-+]?[\d,]*\.?\d+)\)?(?:/\(?([-+]?[\d,]*\.?\d+)\)?)?", s)
    if not m:
        return None
    sign, num, den = m.groups()
    try:
        value = Fraction(_plain(num)) / (Fraction(_plain(den)) if den else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return -value if sign == "-" else value


def _plain(s: str) -> str:
    if "," in s and not re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        raise ValueError(f"bad thousands separators in {s!r}")
    return s.replace(",", "")


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (see ``parse_number``), or None."""
    for m in reversed(list(_NUMBER.finditer(text))):
        v = parse_number(m.group(0))
        if v is not None:
            return v
    return None


def final_answer(text: Any) -> Any:
    """A reference or completion's final answer: what follows GSM8K's last ``####``, else the last ``\\boxed{}``, else
    ``text`` itself (None stays None)."""
    if text is None:
        return None
    s = str(text)
    if "####" in s:
        rest = s.rsplit("####", 1)[1].strip()
        return rest.splitlines()[0].strip() if rest else rest
    boxed = _last_boxed(s)
    return boxed if boxed is not None else text


def _reference(answer: Any, fields: dict) -> Any:
    return final_answer(answer if answer is not None else fields.get("solution"))


def _same_answer(got: str, want: Any) -> bool:
    g, w = parse_number(got), parse_number(str(want))
    if g is not None and w is not None:
        return g == w
    norm = lambda s: re.sub(r"\s+", "", str(s)).strip("$").replace("\\left", "").replace("\\right", "")
    return norm(got) == norm(want)


def exact_match(prompt: str, completion: str, answer: Any = None, **fields: Any) -> float:
    """1.0 if the completion equals the answer (a solution's final answer) after stripping whitespace, else 0.0."""
    answer = _reference(answer, fields)
    return float(answer is not None and completion.strip() == str(answer).strip())


def boxed_match(prompt: str, completion: str, answer: Any = None, **fields: Any) -> float:
    """1.0 if the last ``\\boxed{...}`` equals the answer (numerically when both are numbers), else 0.0."""
    answer, got = _reference(answer, fields), _last_boxed(completion)
    return float(answer is not None and got is not None and _same_answer(got, answer))


def last_number_match(prompt: str, completion: str, answer: Any = None, **fields: Any) -> float:
    """1.0 if the completion's final answer (``#### N`` / last ``\\boxed{}``, else its last number) equals the answer
    exactly (as fractions), else 0.0."""
    answer = _reference(answer, fields)
    want = parse_number(str(answer)) if answer is not None else None
    marked = final_answer(completion)
    got = parse_number(marked) if marked is not completion else None
    got = got if got is not None else last_number(completion)
    return float(want is not None and got is not None and got == want)


def think_answer_format(prompt: str, completion: str, **_: Any) -> float:
    """1.0 for ``<think>...</think>`` followed by a non-empty answer (and no second think block), else 0.0."""
    m = re.fullmatch(r"\s*<think>(.*?)</think>(.*)", completion, flags=re.DOTALL)
    return float(bool(m) and "<think>" not in m.group(2) and bool(m.group(2).strip()))
