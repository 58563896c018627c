"""The data set's ground-truth answers, graded once at load: does Math-Verify parse each of them?

A gold answer Math-Verify cannot parse into a mathematical object (it parses to nothing, or only to its raw text)
is matched by no answer, or only by the identical text (reward/scoring.py), so its question trains at reward 0
however well it is answered: a data set made mostly of them trains at reward 0 and exits 0 without a word.

At load every distinct answer is parsed once, exactly as the grader parses gold
(`reward.scoring.gold_parses`); the rows whose answer does not parse are counted and the first few shown in a
warning, and above `data.max_unparsable_answers` (a fraction of the kept rows) the run is refused at start-up
(exit 2) naming the files, the count and examples. Parsing runs on the main thread (Math-Verify's timeouts use
signal.alarm), with `reward.timeout_seconds`, and a second try of RETRY_TIMEOUT_SECONDS for an answer that found
nothing (a timeout looks the same); a distinct answer costs milliseconds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from exgrpo_megatron.data.datasets import DataFileError, PromptDataset

logger = logging.getLogger(__name__)
EXAMPLES = 5
RETRY_TIMEOUT_SECONDS = 60  # a loaded machine can take seconds for the first parses (Math-Verify's lazy imports)


class UnparsableAnswersError(DataFileError):
    """Too many ground-truth answers of the data set do not parse (over data.max_unparsable_answers)."""


@dataclass(frozen=True)
class AnswerCheck:
    rows: int  # kept rows checked
    unparsable: list[tuple[int, str]]  # (qid, answer) of the rows whose answer does not parse, in qid order

    @property
    def fraction(self) -> float:
        return len(self.unparsable) / self.rows if self.rows else 0.0

    def summary(self, files: list[str]) -> str:
        shown = "; ".join(f"qid {qid}: {answer!r}" for qid, answer in self.unparsable[:EXAMPLES])
        return (f"{len(self.unparsable)} of {self.rows} rows of {files} ({self.fraction:.1%}) have a ground-truth "
                f"answer Math-Verify cannot parse, so they can only ever score 0 (e.g. {shown})")


def check_answers(dataset: PromptDataset, timeout_seconds: int) -> AnswerCheck:
    """Parse every distinct gold answer of `dataset` once; the rows whose answer does not parse."""
    from exgrpo_megatron.reward.scoring import gold_parses

    parses: dict[str, bool] = {}
    bad: list[tuple[int, str]] = []
    for example in dataset:
        ok = parses.get(example.answer)
        if ok is None:  # a parse that timed out looks like one that found nothing: those get a second, long try
            ok = gold_parses(example.answer, timeout_seconds) or gold_parses(example.answer, RETRY_TIMEOUT_SECONDS)
            parses[example.answer] = ok
        if not ok:
            bad.append((example.qid, example.answer))
    return AnswerCheck(len(dataset), bad)


def require_parsable_answers(dataset: PromptDataset, files: list[str], max_fraction: float,
                             timeout_seconds: int) -> AnswerCheck:
    """check_answers, then a warning when some answers of `files` do not parse and UnparsableAnswersError above
    `max_fraction` (data.max_unparsable_answers)."""
    check = check_answers(dataset, timeout_seconds)
    if not check.unparsable:
        return check
    if check.fraction > max_fraction:
        raise UnparsableAnswersError(f"data.max_unparsable_answers: {check.summary(files)}; this run allows "
                                     f"{max_fraction:.1%}. Fix the answers (data.answer_key names the column), or "
                                     "raise data.max_unparsable_answers to train on the rest anyway")
    logger.warning("%s; training on them anyway (data.max_unparsable_answers=%g)", check.summary(files), max_fraction)
    return check
