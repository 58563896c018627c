"""Grading of benchmark generations (``exgrpo_megatron.evaluate``): two graders per response, run in worker
processes while the next batch generates.

Labels (docs/exgrpo.md): the boxed grader decides (``reward.boxed`` for math, the reference's OAT
grader; ``reward.multiple_choice`` for the OOD multiple-choice benchmarks: the boxed option letter);
Math-Verify (``reward.scoring.score_response``) is a second opinion; a different verdict is a disagreement.

:class:`BenchmarkGrading` overlaps grading with generation as a training step does: the caller submits each
response as soon as its engine call returns and collects the verdicts later, in submission order. Both graders
bound their work with Math-Verify's ``signal.alarm`` timeouts, which work only on a process's main thread, so
they run in a small process pool (each worker grades on its main thread), never in a thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ProcessPoolExecutor

from exgrpo_megatron.reward.grader import grader_forkserver_context


def combine_labels(boxed_correct: bool, math_verify_correct: bool) -> tuple[bool, bool]:
    """(label, disagreement): the boxed grader decides; a different Math-Verify verdict is a disagreement."""
    return boxed_correct, boxed_correct != math_verify_correct


def grade_generation(response: str, gold: str, require_think: bool, timeout_seconds: int = 5,
                     data_source: str = "", question: str = "") -> dict:
    """Both graders' verdicts on one response, and the combined label. A multiple-choice (OOD) benchmark's
    boxed verdict is its option letter (``question`` carries the option lines); a math one's the boxed answer."""
    from exgrpo_megatron.reward.boxed import BoxedGrade, grade_boxed
    from exgrpo_megatron.reward.multiple_choice import ChoiceGrade, grade_choice, is_multiple_choice
    from exgrpo_megatron.reward.scoring import score_response

    boxed: BoxedGrade | ChoiceGrade
    if is_multiple_choice(data_source):
        boxed = grade_choice(response, gold, question, require_think)
    else:
        boxed = grade_boxed(response, gold, require_think, timeout_seconds)
    math_verify = score_response(response, gold, require_think, timeout_seconds) == 1.0
    correct, disagree = combine_labels(boxed.correct, math_verify)
    return {"boxed_answer": boxed.prediction, "boxed_correct": boxed.correct, "math_verify_correct": math_verify,
            "correct": correct, "disagree": disagree}


class BenchmarkGrading:
    """``num_workers`` grading processes; :meth:`submit` returns at once, ``Future.result()`` gives the verdict."""

    def __init__(self, num_workers: int = 2, timeout_seconds: int = 5) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"BenchmarkGrading: num_workers must be an int >= 1, got {num_workers!r}")
        self.timeout_seconds = timeout_seconds
        self._pool = ProcessPoolExecutor(num_workers, mp_context=grader_forkserver_context())

    def submit(self, response: str, gold: str, require_think: bool, data_source: str, question: str) -> Future:
        return self._pool.submit(grade_generation, response, gold, require_think, self.timeout_seconds, data_source,
                                 question)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> BenchmarkGrading:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
