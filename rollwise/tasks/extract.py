"""Answer extraction (which part of a response is the answer) and normalisation (when two
answers are the same vote).

Strategies, tried in the configured order until one finds something:
  task         the task's own extractor (built-in arith reverses its least-significant-first
               digits; reasoning-gym and file tasks take the last line)
  answer_tag   the content of the last <answer>...</answer>
  boxed        the content of the last \\boxed{...} (braces balanced)
  answer_is    what follows the last "answer is" / "answer:" up to the end of its sentence
  last_number  the last number (integers, decimals, 1,000-style groups, a/b fractions)
  last_line    the last non-empty line
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable

STRATEGIES = ("task", "answer_tag", "boxed", "answer_is", "last_number", "last_line")
# task.answer_format=auto for reasoning-gym and file tasks: a chat model's usual markers first
AUTO = ("answer_tag", "boxed", "answer_is", "last_line")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+?)\s*(?:\.\s|\.$|\n|$)", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: no answer


def answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def answer_is(text: str) -> str | None:
    found = _ANSWER_IS.findall(text)
    return found[-1].strip().strip("$ ") if found else None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def chain(strategies, task=None, key: str = "filter.extract") -> Callable[[str], str | None]:
    """The first non-empty answer the strategies find, in order ('task' needs a task)."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"{key}: unknown strategy {unknown}; choose from {STRATEGIES}")
    fns = {"answer_tag": answer_tag, "boxed": last_boxed, "answer_is": answer_is,
           "last_number": last_number, "last_line": last_line}
    if task is not None:
        fns["task"] = task.extract_answer
    fns = [fns[s] for s in strategies]

    def extract(text: str) -> str | None:
        for fn in fns:
            got = fn(text)
            if got is not None and got.strip():
                return got.strip()
        return None
    return extract


def task_extractor(answer_format: str) -> Callable[[str], str | None]:
    """A reasoning-gym or file task's own extractor (task.answer_format)."""
    return chain(AUTO if answer_format == "auto" else (answer_format,), key="task.answer_format")


def make_extractor(strategies: list[str], task) -> Callable[[str], str | None]:
    """The configured extractor (filter.extract); [] means the task's own."""
    return chain(list(strategies) or ["task"], task)


_NUM = r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+−]?\.\d+"
_LITERAL = re.compile(rf"(?P<v>(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?)(?:\s*[A-Za-z%°][A-Za-z%°\s]*)?")
_FRAC = re.compile(rf"(?P<s>[-+−]?)\\[dt]?frac\{{(?P<p>{_NUM})\}}\{{(?P<q>{_NUM})\}}")
_STATES = re.compile(r"=|\b(?:is|equals)\b", re.IGNORECASE)  # what follows states a value
_DECORATION = re.compile(r"\\text\{[^}]*\}|\\mathrm\{[^}]*\}|\^\{?\\circ\}?|\\%|\\[,!;]|"
                         r"\$|\\\(|\\\)")


def is_number(text: str) -> bool:
    """The text is a plain number: an integer, decimal or a/b fraction (a numeric reference)."""
    return _as_fraction(text.strip().replace(",", "")) is not None


def numeric_literal(answer: str | None) -> str | None:
    """The number an answer states, or None when it states no single value. An equation
    states its right-hand side ('44 + 27 = 71' -> '71', 'The sum is 71' -> '71'); LaTeX
    wrappers, degree and percent signs and trailing unit words go ('10\\text{ cm}',
    '18 dollars'); \\frac{p}{q} with numbers stays a fraction. An expression ('52 * 53',
    '46 - 69') is not a literal: a verifier that evaluates it would reward restating the
    problem."""
    if answer is None:
        return None
    s = answer.strip()
    boxed = last_boxed(s)
    s = _STATES.split(boxed if boxed is not None else s)[-1]
    s = _DECORATION.sub(" ", s).strip().rstrip(".").strip()
    frac = _FRAC.fullmatch(s)
    if frac:
        return f"{frac['s']}{frac['p']}/{frac['q']}".replace("−", "-")
    m = _LITERAL.fullmatch(s)
    return m["v"].replace("−", "-").replace(" ", "") if m else None


def normalize(answer: str | None) -> str | None:
    """A canonical form for voting: LaTeX wrappers, units text, spaces and thousands commas
    removed, numbers (incl. \\frac and a/b) written as reduced fractions or integers."""
    if answer is None:
        return None
    s = answer.strip().strip("$").strip()
    boxed = last_boxed(s)
    s = boxed if boxed is not None else s
    s = re.sub(r"\\text\{[^}]*\}|\\mathrm\{[^}]*\}", "", s)
    s = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"(\1)/(\2)", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\s+", "", s).rstrip(".").lower()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?0\d+", s):
        return s  # a leading zero makes a digit string (e.g. reversed digits), not a number
    number = _as_fraction(s)
    if number is not None:
        return str(number.numerator) if number.denominator == 1 else f"{number}"
    return s or None


def _as_fraction(s: str) -> Fraction | None:
    num = r"(-?(?:\d+(?:\.\d*)?|\.\d+))"
    m = re.fullmatch(rf"\(?{num}\)?(?:/\(?{num}\)?)?", s)
    if not m:
        return None
    try:
        value = Fraction(m.group(1))
        return value / Fraction(m.group(2)) if m.group(2) else value
    except (ZeroDivisionError, ValueError):
        return None
