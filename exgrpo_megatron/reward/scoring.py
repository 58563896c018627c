"""Pure Math-Verify scoring of one response (docs/exgrpo.md).

Reference rule (``mix_src/math_verify_reward.reward_fn_math_verify``): the prompt ends with
``<think>\\n``, so the decoded response is prefixed with ``"<think>\\n"``; if ``<think>`` or
``</think>`` is missing the reward is 0; otherwise ``answer = text.split("</think>")[1]`` and

    reward = 1[ math_verify.verify(parse("$" + gold + "$"), parse(answer)) ]

with any exception giving 0. Without the think requirement the whole response is graded.

Math-Verify bounds its own work with ``signal.alarm``, which only works on a process's main thread
and only with an integer timeout >= 1 (a float makes ``alarm`` raise inside ``verify``, which then
silently returns False for every answer) — hence :func:`validate_timeout` and the main-thread check.
"""

from __future__ import annotations

import threading

from math_verify import parse, verify

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
THINK_PREFIX = "<think>\n"

_GOLD_CACHE_MAX = 4096
_gold_cache: dict[tuple[str, int], list] = {}


def validate_timeout(timeout_seconds: object) -> int:
    """Return ``timeout_seconds`` if it is an ``int >= 1`` (bool rejected), else raise ValueError."""
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, int) or timeout_seconds < 1:
        raise ValueError(
            f"Math-Verify timeout must be an int >= 1 (signal.alarm takes whole seconds; anything else makes "
            f"every answer grade as wrong), got {timeout_seconds!r}"
        )
    return timeout_seconds


def extract_answer(response_text: str, require_think: bool) -> str | None:
    """The part of the response to grade, or None when the think format is required but broken.

    With ``require_think``: ``text = "<think>\\n" + response``; None unless both tags occur; else
    ``text.split("</think>")[1]`` (the segment after the first ``</think>``, as the reference does).
    """
    if not require_think:
        return response_text
    text = THINK_PREFIX + response_text
    if THINK_OPEN not in text or THINK_CLOSE not in text:
        return None
    return text.split(THINK_CLOSE)[1]


def _parse_gold(gold: str, timeout_seconds: int) -> list:
    """``parse("$" + gold + "$")``, memoised per process (a group's 8 rollouts share one gold).

    Empty parses (e.g. a parse that timed out under load) are not cached.
    """
    key = (gold, timeout_seconds)
    cached = _gold_cache.get(key)
    if cached is not None:
        return cached
    parsed = parse("$" + gold + "$", parsing_timeout=timeout_seconds)
    if parsed:
        if len(_gold_cache) >= _GOLD_CACHE_MAX:
            _gold_cache.clear()
        _gold_cache[key] = parsed
    return parsed


def gold_parses(gold: str, timeout_seconds: int) -> bool:
    """Whether Math-Verify parses this gold answer (as the grader does) into a mathematical object. One that does not
    parses to nothing (never matched) or to its raw text only (matched only by the identical text)."""
    _require_main_thread()
    try:
        parsed = _parse_gold(gold, validate_timeout(timeout_seconds))
    except Exception:
        return False
    return any(not isinstance(x, str) for x in parsed)


def _require_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "Math-Verify timeouts use signal.alarm and only work on the main thread; grade in a GraderPool "
            "(a process pool whose workers grade on their main thread) instead of a thread"
        )


def score_answer(answer: str, gold: str, timeout_seconds: int) -> float:
    """``1.0`` if Math-Verify says ``answer`` equals ``gold`` (parse timeouts and verify timeout as given), else 0."""
    timeout = validate_timeout(timeout_seconds)
    _require_main_thread()
    try:
        gold_parsed = _parse_gold(gold, timeout)
        answer_parsed = parse(answer, parsing_timeout=timeout)
        return 1.0 if verify(gold_parsed, answer_parsed, timeout_seconds=timeout) else 0.0
    except Exception:
        return 0.0


def score_response(response_text: str, gold: str, require_think: bool, timeout_seconds: int) -> float:
    """Binary reward of one decoded response against the gold answer (reference §4.3, see module doc)."""
    timeout = validate_timeout(timeout_seconds)
    answer = extract_answer(response_text, require_think)
    if answer is None:
        return 0.0
    return score_answer(answer, gold, timeout)


def warm_up_math_verify(timeout_seconds: int = 5) -> None:
    """Grade a few representative answers (fraction, decimal, sqrt, percent) on the main thread: the first
    parse/verify of a process costs ~0.2 s (lazy imports, parser construction); reward/worker_warmup.py."""
    for answer, gold in (("\\boxed{\\frac{2}{4}}", "0.5"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), ("50\\%", "50")):
        score_answer(answer, gold, timeout_seconds)
