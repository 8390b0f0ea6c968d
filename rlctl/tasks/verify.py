"""Answer extraction and a math verifier that accepts equivalent forms.

``answers_equivalent(completion, answer)`` is true when the completion's final answer
equals ``answer``: "46", "46.0", "4.6e1", "46/1", "92/2", "+46", "$46$", "\\boxed{46}",
"The answer is 46.", "4 6" (digits spaced out, as the tiny model writes them), and
"1,234" / "1 234" for 1234 all match 46 / 1234. Two checks, either suffices:

1. a numeric parser (always available): the final answer is the content of the last
   ``\\boxed{...}``, else what follows the last "####" or "answer is"/"answer:", else the
   whole text; its last number (integer, decimal, scientific, or a/b fraction, with
   thousands commas) is compared exactly as a rational number;
2. ``math_verify`` (Hugging Face's math-verify, a dependency) on the same text, which
   also handles LaTeX (``\\frac{1}{2}``, sets, intervals, expressions), so the same
   reward works for real math datasets: ``task.reward_fn=math`` on a data task.

math-verify's own time limits use SIGALRM, which only works in a process's main thread;
elsewhere they are switched off (the reward scorer's per-batch limit still applies).
"""
from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction
from typing import Any, Optional

_BOXED = re.compile(r"\\boxed\s*\{")
_MARKERS = re.compile(r"####|answer\s*(?:is|:)|answer\s*=", re.IGNORECASE)
_SPACED_DIGITS = re.compile(r"(?<=\d) (?=\d)")
_SIGN_SPACE = re.compile(r"(?<![\w)])([-+]) (?=\d)")
_NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
    r"(?:\s*/\s*[-+]?\d+(?:\.\d+)?)?")


def _last_boxed(text: str) -> Optional[str]:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return text[i:]


def normalize_spacing(text: str) -> str:
    """Join digits written with single spaces ("4 6" -> "46", "- 1 2" -> "-12")."""
    return _SIGN_SPACE.sub(r"\1", _SPACED_DIGITS.sub("", text))


def final_answer_text(text: str) -> str:
    """The part of a completion that holds the final answer (see the module doc)."""
    if not isinstance(text, str):
        return ""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    marks = list(_MARKERS.finditer(text))
    return text[marks[-1].end():] if marks else text


def _to_fraction(token: str) -> Optional[Fraction]:
    token = token.replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/", 1)
            d = Fraction(den)
            return Fraction(num) / d if d != 0 else None
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: Any) -> Optional[Fraction]:
    """The final answer as an exact rational number, or None."""
    if not isinstance(text, str):
        if isinstance(text, (int, Fraction)) and not isinstance(text, bool):
            return Fraction(text)
        if isinstance(text, float):
            return Fraction(repr(text))   # 0.1 means 1/10, not the binary float's exact value
        return None
    part = normalize_spacing(final_answer_text(text)).replace("$", " ")
    found = _NUMBER.findall(part)
    return _to_fraction(found[-1]) if found else None


def _math_verify(completion: str, answer: str) -> bool:
    try:   # only for math answers (reward_fn=math), and slow to import (about 0.4 s)
        from math_verify import parse, verify
    except ImportError:  # pragma: no cover - math-verify is a dependency
        return False
    main = threading.current_thread() is threading.main_thread()
    if not main:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    limit = {} if main else {"parsing_timeout": None}
    try:
        gold = parse(answer, **limit)
        pred = parse(completion, **limit)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, **({} if main else {"timeout_seconds": None})))
    except Exception:  # noqa: BLE001 - a verifier never raises on bad text
        return False


def plain_number(answer: Any) -> Optional[Fraction]:
    """``answer`` as a rational number when it is one ("46", "-1,234", "0.5", "1/2", 46)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, float):
        return Fraction(repr(answer))     # 0.1 means 1/10, not the binary float's exact value
    if isinstance(answer, (int, Fraction)):
        return Fraction(answer)
    if not isinstance(answer, str):
        return None
    text = normalize_spacing(answer.strip().strip("$").strip())
    return _to_fraction(text) if _NUMBER.fullmatch(text or "x") else None


def answers_equivalent(completion: Any, answer: Any) -> bool:
    """Is the completion's final answer equal to ``answer`` (a number or math text)?"""
    if not isinstance(completion, str) or not completion.strip():
        return False
    target = plain_number(answer)
    if target is not None:
        got = parse_number(completion)
        if got == target:
            return True
        if got is not None and not any(ch in completion for ch in "\\{}^"):
            return False  # a plain number that differs: math-verify cannot disagree
    gold = answer if isinstance(answer, str) else str(answer)
    return _math_verify(normalize_spacing(completion), gold)


def math_reward(prompt: Any, completion: str, answer: Any = None, **_fields) -> float:
    """A data-task reward: 1.0 when the completion's final answer equals the ``answer``
    field (``task.reward_fn=math``), else 0.0."""
    if answer is None:
        raise ValueError("the math reward needs an 'answer' field in the data")
    return float(answers_equivalent(completion, answer))


def exact_reward(prompt: Any, completion: str, answer: Any = None, **_fields) -> float:
    """A data-task reward: 1.0 when the completion, stripped, equals the ``answer`` field
    as text (``task.reward_fn=exact``)."""
    if answer is None:
        raise ValueError("the exact reward needs an 'answer' field in the data")
    return float(isinstance(completion, str) and completion.strip() == str(answer).strip())
