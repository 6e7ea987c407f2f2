"""A math answer checker: pull the final answer out of a completion and compare it with the
reference by value, not by string.

Extraction, first that applies: the last `\\boxed{...}`; the text after the last `answer`
(`answer:`, `Answer is`, ...); the last number in the text. Comparison: both sides are
normalised (spaces, `$`, thousands commas, a trailing period, `\\frac{a}{b}`, `\\dfrac`,
`\\left`/`\\right`, percent signs) and compared as exact rationals (`3/4` = `0.75` = `.75`);
failing that, as symbolic expressions with sympy (`2*(x+1)` = `2x+2`), but only when both
sides consist of digits, single-letter variables, operators and parentheses: model output is
never handed to a parser that evaluates arbitrary code.

Digit-level tokenizers write `1 2` for twelve: spaces between digits are removed first.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER = re.compile(r"answer\s*(?:is|:|=)?\s*", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_SAFE_EXPR = re.compile(r"^[0-9a-z+\-*/^().]+$")


def _boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer a completion states, or None."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    found = list(_ANSWER.finditer(text))
    if found:
        tail = text[found[-1].end() :].strip()
        if tail:
            return tail.split("\n")[0].strip()
    numbers = _NUMBER.findall(normalize(text))
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    s = answer.strip().rstrip(".").replace("$", "").replace("\\left", "").replace("\\right", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"(?<=\d) +(?=\d)", "", s)  # digit-level tokens: "1 2" -> "12"
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators
    while _FRAC.search(s):
        s = _FRAC.sub(r"(\1)/(\2)", s)
    return s.replace(" ", "").replace("\\cdot", "*").replace("\\times", "*").lower()


def _rational(s: str) -> Fraction | None:
    s = s.strip("()")
    m = re.fullmatch(r"\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", s)
    try:
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _symbolic_equal(a: str, b: str) -> bool:
    if not (_SAFE_EXPR.match(a) and _SAFE_EXPR.match(b)) or len(a) > 100 or len(b) > 100:
        return False
    if re.search(r"[a-z]{2}", a + b):  # names longer than one letter could be functions
        return False
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = (*standard_transformations, implicit_multiplication_application)
    try:
        ea = parse_expr(a.replace("^", "**"), transformations=transformations, evaluate=True)
        eb = parse_expr(b.replace("^", "**"), transformations=transformations, evaluate=True)
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # noqa: BLE001 - any parse or simplification failure means "not equal"
        return False


def answers_match(given: str | None, reference: str | int | float) -> bool:
    if given is None:
        return False
    a, b = normalize(given), normalize(str(reference))
    if a == b:
        return True
    ra, rb = _rational(a), _rational(b)
    if ra is not None and rb is not None:
        return ra == rb
    return _symbolic_equal(a, b)


def math_reward(completion: str, reference: str | int | float) -> float:
    """1.0 if the completion's final answer equals the reference, else 0.0."""
    return 1.0 if answers_match(extract_answer(completion), reference) else 0.0
