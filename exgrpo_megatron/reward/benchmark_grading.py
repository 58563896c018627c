"""Grading of benchmark generations (``exgrpo_megatron.evaluate``): two graders per response, run in worker
processes while the next batch generates.

Labels (docs/exgrpo.md): the boxed grader decides (``reward.boxed`` for math, the reference's OAT
grader; ``reward.multiple_choice`` for the OOD multiple-choice benchmarks: the boxed option letter);
Math-Verify (``reward.scoring.score_response``) is a second opinion; a different verdict is a disagreement.

:class:`BenchmarkGrading` overlaps grading with generation as a training step does: :class:`BenchmarkSink` is the
rollout service's grading sink of one engine call (rollout_service.py), so each response goes to the pool as soon
as the engine batch that finishes it is done, and the verdicts are collected later, in question order. Both graders
bound their work with Math-Verify's ``signal.alarm`` timeouts, which work only on a process's main thread, so
they run in a small process pool (each worker grades on its main thread), never in a thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field

from exgrpo_megatron.data.tokenizer import Tokenizer
from exgrpo_megatron.reward.grader import grader_forkserver_context
from exgrpo_megatron.rollout.types import Sample

THINK_PREFIX = "<think>\n"


@dataclass(frozen=True)
class Question:
    """One unique (data_source, question, gold); ``qids`` are the dataset rows that carry it."""

    index: int
    data_source: str
    question: str
    gold: str
    prompt_ids: list[int]
    qids: list[int] = field(default_factory=list)


def prompt_requires_think(prompt_text: str) -> bool:
    """The reference rule: a prompt ending with ``<think>\\n`` makes ``</think>`` mandatory in the response."""
    return prompt_text.endswith(THINK_PREFIX)


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


class BenchmarkSink:
    """The grading sink of one engine call over ``questions`` (rollout_service.GradingSink): each finished
    question's samples become generation records (response decoded without special tokens), submitted to
    ``grading`` at once; :meth:`result` waits for the verdicts and returns the records question by question,
    sample by sample. With ``grading=None`` (ranks != 0 of a TP group) nothing is graded or recorded."""

    def __init__(self, grading: BenchmarkGrading | None, tokenizer: Tokenizer, questions: list[Question]) -> None:
        self.grading, self.tokenizer, self.questions = grading, tokenizer, questions
        self._pending: list[list[tuple[dict, Future]]] = [[] for _ in questions]  # per question: (record, verdict)

    def submit(self, indices: list[int], samples: list[list[Sample]]) -> None:
        if self.grading is None:
            return
        for i, group in zip(indices, samples, strict=True):
            q = self.questions[i]
            require_think = prompt_requires_think(self.tokenizer.decode(q.prompt_ids))
            for j, sample in enumerate(group):
                response = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
                rec = {"data_source": q.data_source, "question_index": q.index, "sample_index": j, "qids": q.qids,
                       "question": q.question, "gold": q.gold, "response": response,
                       "finish_reason": sample.finish_reason, "response_tokens": len(sample.response_ids)}
                verdict = self.grading.submit(response, q.gold, require_think, q.data_source, q.question)
                self._pending[i].append((rec, verdict))

    def result(self) -> list[dict]:
        records = []
        for question_records in self._pending:
            for rec, verdict in question_records:
                rec.update(verdict.result())
                records.append(rec)
        return records
