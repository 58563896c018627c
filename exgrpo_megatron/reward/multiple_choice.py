"""Multiple-choice questions of the out-of-distribution benchmarks (ARC-c, GPQA-diamond, MMLU-Pro): their prompt
text and the answer-letter grader (docs/exgrpo.md; the paper's OOD columns).

Prompt (the question text stored in the data file; the prompt template, e.g. ``own``, wraps it as any
question). As in the reference evaluation files (LUFFY ``data/valid.{arc_c,gpqa}.parquet``):

* ARC-c: ``{question}\\n\\n`` then one line per option, ``{label}) {text}\\n``; the dataset's own labels
  (A-D, or 1-4 for the few ARC questions labelled by number).
* GPQA-diamond: the instruction ``Answer the following multiple choice question. The last line of your
  response should be of the following format: 'ANSWER: $LETTER' (without quotes) where LETTER is one of
  ABCD. Think step by step before answering.``, a blank line, the question, a blank line, then the options
  ``A) ...`` joined by newlines (the correct answer is placed among the three wrong ones by a seeded shuffle:
  the dataset stores it apart).
* MMLU-Pro (up to ten options, A-J): the GPQA form with the letters of its options (the reference's MMLU-Pro
  file is not public in its repository; this is the same instruction family, as OpenAI's simple-evals uses).

Grading (the reference labels OOD answers with the same boxed grader as math, ``--add_oat_evaluate``):
with a think template only the text after ``</think>`` counts; the prediction is the content of the LAST
``\\boxed{}`` there, normalised as a math answer (``boxed.normalize_answer``: ``\\text{(C)}`` -> ``C``), and it
is correct when it IS the gold option label. A box around the option's text, around several letters, or no
box at all is wrong, as in the reference (an ``ANSWER: C`` line without a box scores 0 there too).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from exgrpo_megatron.reward.boxed import last_boxed_content, normalize_answer
from exgrpo_megatron.reward.scoring import extract_answer

MC_BENCHMARKS: tuple[str, ...] = ("arc_c", "gpqa_diamond", "mmlu_pro")  # data_source names of the OOD rows
LETTERS = "ABCDEFGHIJ"
_OPTION_LINE = re.compile(r"^([A-J]|[1-9])\) ", re.MULTILINE)


def is_multiple_choice(data_source: str) -> bool:
    """True for the data_source of an OOD multiple-choice benchmark (case-insensitive)."""
    return data_source.lower() in MC_BENCHMARKS


def instruction(letters: str) -> str:
    """The answer-format instruction that opens a GPQA / MMLU-Pro question."""
    return ("Answer the following multiple choice question. The last line of your response should be of the "
            f"following format: 'ANSWER: $LETTER' (without quotes) where LETTER is one of {letters}. "
            "Think step by step before answering.")


def options_block(labels: Sequence[str], texts: Sequence[str]) -> str:
    if len(labels) != len(texts) or not texts:
        raise ValueError(f"options: {len(labels)} labels for {len(texts)} texts")
    return "\n".join(f"{label}) {text}" for label, text in zip(labels, texts, strict=True))


def arc_question(question: str, labels: Sequence[str], texts: Sequence[str]) -> str:
    """ARC-c question text: the question, a blank line, one ``label) text`` line per option."""
    return f"{question.strip()}\n\n{options_block(labels, texts)}\n"


def lettered_question(question: str, texts: Sequence[str]) -> str:
    """GPQA / MMLU-Pro question text: the instruction, the question, options lettered A, B, ... in order."""
    letters = LETTERS[:len(texts)]
    if len(texts) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} options, got {len(texts)}")
    return f"{instruction(letters)}\n\n{question.strip()}\n\n{options_block(letters, texts)}"


def shuffled_options(correct: str, wrong: Sequence[str], seed: int) -> tuple[list[str], str]:
    """(options, gold letter): the correct answer among the wrong ones in a seeded random order (GPQA stores it
    apart); the same seed gives the same order on every machine."""
    options = [correct, *wrong]
    order = list(range(len(options)))
    random.Random(seed).shuffle(order)
    return [options[i] for i in order], LETTERS[order.index(0)]


def option_labels(question: str) -> list[str]:
    """The option labels a question text offers (``A) ...`` / ``1) ...`` lines), in order."""
    return _OPTION_LINE.findall(question)


@dataclass(frozen=True)
class ChoiceGrade:
    """The extracted option label (None when the box is missing or holds no single label) and its verdict."""

    prediction: str | None
    correct: bool


def extract_choice(response_text: str, labels: Sequence[str], require_think: bool) -> str | None:
    """The option label in the last ``\\boxed{}`` of the graded region, or None (see module doc)."""
    region = extract_answer(response_text, require_think)
    boxed = None if region is None else last_boxed_content(region)
    if boxed is None:
        return None
    label = normalize_answer(boxed)
    return label if label in labels else None


def grade_choice(response_text: str, gold: str, question: str, require_think: bool) -> ChoiceGrade:
    """Grade one response to a multiple-choice question (``question``: its text with the option lines)."""
    labels = option_labels(question) or list(LETTERS)
    prediction = extract_choice(response_text, labels, require_think)
    return ChoiceGrade(prediction, prediction is not None and prediction == gold.strip())
