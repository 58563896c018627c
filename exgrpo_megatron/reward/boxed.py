"""Boxed-answer grader for benchmark evaluation (docs/exgrpo.md).

The reference evaluation (``eval_scripts/generate_vllm.py`` with ``--add_oat_evaluate True``) labels a
response by its LAST ``\\boxed{...}`` and a symbolic/numeric comparison with the gold answer. This module
does the same with our own rules:

1. Region: with a think template, ``"<think>\\n" + response`` must contain ``</think>`` and only the text
   after the first ``</think>`` is graded (``scoring.extract_answer``); else the whole response.
2. Extraction: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or the
   token after ``\\boxed `` (``\\boxed 5``). No box, or an unbalanced last box: wrong.
3. Comparison, after :func:`normalize_answer` on both sides: equal strings are correct; otherwise
   ``math_verify.verify(parse("$" + gold + "$"), parse("$" + prediction + "$"))`` (sympy symbolic and
   numeric equality, Math-Verify's own timeouts). Any exception: wrong.

Math-Verify bounds its work with ``signal.alarm``, which works only on the main thread, so grading
refuses to run elsewhere (as ``reward.scoring`` does).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from math_verify import parse, verify

from exgrpo_megatron.reward.scoring import extract_answer, validate_timeout

BOX_COMMANDS = ("\\boxed", "\\fbox")

_SPACING = re.compile(r"\\[!,;: ]|\\(?:displaystyle|left|right|big|Big)(?![A-Za-z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\circ|\\degree")
_TEXT_WRAPPED = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{(.*)\}$", re.DOTALL)
_TRAILING_UNIT = re.compile(r"\s*\\(?:text|mbox|mathrm)\{[^{}]*\}\s*$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_SHORT_ASSIGNMENT = re.compile(r"^[A-Za-z](?:_\{?\w\}?)?\s*=\s*(.+)$", re.DOTALL)
_FRAC_DIGITS = re.compile(r"\\frac(\d)(\d)")
_SQRT_DIGIT = re.compile(r"\\sqrt(\d)")
_CHOICE = re.compile(r"^\(([A-Ea-e])\)$")


@dataclass(frozen=True)
class BoxedGrade:
    """The extracted boxed content (None when missing) and whether it matches the gold answer."""

    prediction: str | None
    correct: bool


def _closing_brace(text: str, open_index: int) -> int | None:
    """Index of the brace closing ``text[open_index] == "{"``, or None when unbalanced."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (balanced braces), the token of ``\\boxed X``, or None."""
    start = max(text.rfind(cmd) for cmd in BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in BOX_COMMANDS if text.startswith(c, start))
    pos = start + len(cmd)
    if pos < len(text) and text[pos] == "{":
        end = _closing_brace(text, pos)
        return None if end is None else text[pos + 1:end]
    if pos < len(text) and text[pos] == " ":
        token = text[pos:].strip().split()
        return token[0].rstrip("$") if token else None
    return None


def strip_boxed(answer: str) -> str:
    """A gold answer written as ``\\boxed{x}`` becomes ``x``; anything else is returned unchanged."""
    stripped = answer.strip()
    if stripped.startswith(BOX_COMMANDS):
        inner = last_boxed_content(stripped)
        if inner is not None:
            return inner
    return answer


def normalize_answer(answer: str) -> str:
    """Canonical string form of a short math answer.

    Removes ``$``, spacing commands, ``\\left``/``\\right``, degrees (``^\\circ``), ``\\%``/``%``/``\\$``,
    a trailing ``\\text{unit}`` (a wholly wrapped ``\\text{X}`` becomes ``X``), a trailing ``.``, a short
    ``x =`` prefix and all whitespace; ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``,
    ``\\sqrt2`` -> ``\\sqrt{2}``, ``1,000`` -> ``1000``, ``(B)`` -> ``B``.
    """
    s = answer.strip().strip("$").strip()
    s = _SPACING.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREES.sub("", s).replace("\\%", "").replace("%", "").replace("\\$", "")
    wrapped = _TEXT_WRAPPED.match(s.strip())
    if wrapped:
        s = wrapped.group(1)
    else:
        s = _TRAILING_UNIT.sub("", s)
    s = s.strip().rstrip(".").strip()
    assignment = _SHORT_ASSIGNMENT.match(s)
    if assignment:
        s = assignment.group(1)
    s = _FRAC_DIGITS.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_DIGIT.sub(r"\\sqrt{\1}", s)
    s = re.sub(r"\s+", "", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    choice = _CHOICE.match(s)
    return choice.group(1).upper() if choice else s


def answers_match(prediction: str, gold: str, timeout_seconds: int = 5) -> bool:
    """Normalized string equality, else Math-Verify symbolic/numeric equality (see module docstring)."""
    timeout = validate_timeout(timeout_seconds)
    pred, ref = normalize_answer(prediction), normalize_answer(strip_boxed(gold))
    if not pred:
        return False
    if pred == ref:
        return True
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("answers_match uses Math-Verify's signal.alarm timeouts and must run on the main thread")
    try:
        gold_parsed = parse("$" + ref + "$", parsing_timeout=timeout)
        pred_parsed = parse("$" + pred + "$", parsing_timeout=timeout)
        return bool(gold_parsed) and bool(pred_parsed) and bool(
            verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:
        return False


def grade_boxed(response_text: str, gold: str, require_think: bool, timeout_seconds: int = 5) -> BoxedGrade:
    """Grade one decoded response: think region, last box, comparison (module docstring steps 1-3)."""
    region = extract_answer(response_text, require_think)
    prediction = None if region is None else last_boxed_content(region)
    if prediction is None:
        return BoxedGrade(None, False)
    return BoxedGrade(prediction, answers_match(prediction, gold, timeout_seconds))
