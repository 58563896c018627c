"""The built-in verifiable task of the CPU demo: integer arithmetic in four tiers, one-digit operands.

Tiers (so that a small model's questions spread over the correctness buckets 0..K):
* 0: ``a+b``;
* 1: ``a-b`` (answers may be negative);
* 2: ``a*b``;
* 3: ``a+b+c`` (two steps, ``"a+b=s, s+c=t"``; 1000 distinct questions, the others have 100).

Harder tiers for the fidelity preset (`conf/fidelity_cpu.yaml`, not in the demo's default ``ALL_TIERS``):
* 4: ``ab+c`` (two-digit plus one-digit, carries; 900 distinct);
* 5: ``ab+cd`` (two two-digit operands; 8100 distinct);
* 6: ``a*b+c`` (a product, then a sum: two steps; 1000 distinct);
* 7: ``ab-c`` (two-digit minus one-digit, borrows; 900 distinct).
:func:`make_arithmetic_splits` draws DISTINCT questions for disjoint train / validation / test splits (a finite
training set revisited over epochs, a held-out test set), equal shares per tier.

Every tier is within reach of the demo's small model (4 layers, width 128): after the short warm start it
solves each tier sometimes, and RL raises all four. Two-digit operands and two-step products (``a+b*c``,
``(a+b)*c``, the earlier tiers 1 and 3) stayed at 0-2% and 4-7% accuracy (temperature 1) after 80-100 RL steps, so a
quarter to a half of every batch carried no learning signal (all-wrong groups have zero advantage).

A question is ``"<expression>=?"`` (digits, ``+ - * ( ) = ?`` only, all in the CharTokenizer vocabulary); the
gold answer is the integer value as a string. :func:`solution_text` writes the short worked response that
follows the ``plain`` template's prompt (``"{question}\\n<think>\\n"``): the evaluation steps, ``</think>``,
then ``\\boxed{answer}``, e.g. ``"3+4=7, 7+5=12</think>\\boxed{12}"``; the grader prepends ``"<think>\\n"``
(docs/exgrpo.md) and scores it 1.0. It is the supervised warm-start corpus of the demo. The parser
(:func:`evaluate_with_steps`) also handles parentheses and longer expressions, for other uses of
:func:`solution_text`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from exgrpo_megatron.data.datasets import PromptDataset, TextEncoder, prompt_dataset_from_pairs
from exgrpo_megatron.data.templates import render_prompt

ALL_TIERS: tuple[int, ...] = (0, 1, 2, 3)  # the demo's default tiers
KNOWN_TIERS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)
QUESTION_SUFFIX = "=?"
STEP_SEPARATOR = ", "


def _tier_expression(tier: int, rng: np.random.Generator) -> str:
    """One random expression of ``tier`` (see module doc)."""
    if tier not in KNOWN_TIERS:
        raise ValueError(f"unknown arithmetic tier {tier}; expected one of {KNOWN_TIERS}")
    if tier <= 3:
        operands = rng.integers(0, 10, size=3 if tier == 3 else 2)
        op = {0: "+", 1: "-", 2: "*", 3: "+"}[tier]
        return op.join(str(x) for x in operands)
    if tier in (4, 7):
        return f"{rng.integers(10, 100)}{'+' if tier == 4 else '-'}{rng.integers(0, 10)}"
    if tier == 5:
        return f"{rng.integers(10, 100)}+{rng.integers(10, 100)}"
    a, b, c = rng.integers(0, 10, size=3)
    return f"{a}*{b}+{c}"


def _triple(expression: str, tier: int) -> tuple[str, str, int]:
    value, _ = evaluate_with_steps(expression)
    return expression + QUESTION_SUFFIX, str(value), int(tier)


def make_arithmetic_dataset(n: int, seed: int, tiers: Sequence[int] = ALL_TIERS) -> list[tuple[str, str, int]]:
    """``n`` deterministic ``(question, answer, tier)`` triples; tiers are equally represented (±1) in shuffled
    order. Questions may repeat (tier 0 has only 100 distinct ones)."""
    if n < 0:
        raise ValueError(f"make_arithmetic_dataset: n must be >= 0, got {n}")
    if not tiers:
        raise ValueError("make_arithmetic_dataset: tiers is empty")
    rng = np.random.default_rng([seed, 0xA817])
    assigned = rng.permutation(np.resize(np.asarray(list(tiers), dtype=np.int64), n))
    return [_triple(_tier_expression(int(tier), rng), int(tier)) for tier in assigned.tolist()]


def make_arithmetic_splits(sizes: Sequence[int], seed: int, tiers: Sequence[int]) -> list[list[tuple[str, str, int]]]:
    """Disjoint splits of DISTINCT ``(question, answer, tier)`` triples, ``sizes[j]`` in split j (e.g. train,
    validation, test). Each split has equal tier shares (±1, shuffled); no question occurs twice in or across
    splits. Deterministic in (sizes, seed, tiers). Raises ValueError when a tier has too few distinct questions."""
    if any(n < 0 for n in sizes):
        raise ValueError(f"make_arithmetic_splits: sizes must be >= 0, got {list(sizes)}")
    if not tiers:
        raise ValueError("make_arithmetic_splits: tiers is empty")
    rng = np.random.default_rng([seed, 0x5E17])
    seen: set[str] = set()
    splits = []
    for n in sizes:
        assigned = rng.permutation(np.resize(np.asarray(list(tiers), dtype=np.int64), n))
        split = []
        for tier in assigned.tolist():
            for _ in range(100_000):
                expression = _tier_expression(int(tier), rng)
                if expression not in seen:
                    break
            else:
                raise ValueError(f"arithmetic tier {tier} has too few distinct questions for splits {list(sizes)}")
            seen.add(expression)
            split.append(_triple(expression, int(tier)))
        splits.append(split)
    return splits


def task_fingerprint(tiers: Sequence[int] = ALL_TIERS) -> str:
    """Short digest of the task's definition (a fixed sample of every tier used), for cache keys."""
    sample = make_arithmetic_dataset(64, seed=0, tiers=tiers)
    return hashlib.sha256(repr(sample).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------- evaluation
def _tokenize(expression: str) -> list[str]:
    tokens: list[str] = []
    i = 0
    while i < len(expression):
        char = expression[i]
        if char.isdigit():
            j = i
            while j < len(expression) and expression[j].isdigit():
                j += 1
            tokens.append(expression[i:j])
            i = j
        elif char in "+-*()":
            tokens.append(char)
            i += 1
        elif char == " ":
            i += 1
        else:
            raise ValueError(f"unexpected character {char!r} in arithmetic expression {expression!r}")
    return tokens


def evaluate_with_steps(expression: str) -> tuple[int, list[str]]:
    """Value of an integer ``+ - *`` expression with parentheses (usual precedence, left associative) and the
    list of binary steps ``"l<op>r=v"`` in evaluation order."""
    tokens = _tokenize(expression)
    steps: list[str] = []
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"unexpected end of arithmetic expression {expression!r}")
        pos += 1
        return tokens[pos - 1]

    def apply(left: int, op: str, right: int) -> int:
        value = left + right if op == "+" else left - right if op == "-" else left * right
        steps.append(f"{left}{op}{right}={value}")
        return value

    def factor() -> int:
        token = take()
        if token == "(":
            value = expr()
            if take() != ")":
                raise ValueError(f"missing ')' in {expression!r}")
            return value
        if not token.isdigit():
            raise ValueError(f"expected a number, got {token!r} in {expression!r}")
        return int(token)

    def term() -> int:
        value = factor()
        while peek() == "*":
            take()
            value = apply(value, "*", factor())
        return value

    def expr() -> int:
        value = term()
        while peek() in ("+", "-"):
            op = take()
            value = apply(value, op, term())
        return value

    value = expr()
    if pos != len(tokens):
        raise ValueError(f"trailing tokens {tokens[pos:]} in {expression!r}")
    return value, steps


def question_expression(question: str) -> str:
    """The expression of a ``"<expression>=?"`` question."""
    if not question.endswith(QUESTION_SUFFIX):
        raise ValueError(f"not an arithmetic question (no {QUESTION_SUFFIX!r} suffix): {question!r}")
    return question[: -len(QUESTION_SUFFIX)]


def solution_text(question: str, answer: str) -> str:
    """Worked response after the ``plain`` prompt: ``"<steps></think>\\boxed{<answer>}"``.

    The steps are the evaluation steps joined by ``", "``; a bare number question restates itself. Raises
    ValueError when ``answer`` is not the value of the question.
    """
    value, steps = evaluate_with_steps(question_expression(question))
    if str(value) != answer.strip():
        raise ValueError(f"answer {answer!r} is wrong for {question!r} (value {value})")
    reasoning = STEP_SEPARATOR.join(steps) if steps else str(value)
    return f"{reasoning}</think>\\boxed{{{value}}}"


# ----------------------------------------------------------------------------------------- datasets
def build_arithmetic_prompt_dataset(n: int, seed: int, tokenizer: TextEncoder, template: str = "plain",
                                    max_prompt_length: int = 32,
                                    tiers: Sequence[int] = ALL_TIERS) -> PromptDataset:
    """The synthetic task as a PromptDataset (qid = index in :func:`make_arithmetic_dataset`; each example's
    ``data_source`` is ``"arithmetic/tier<k>"``). Use different seeds for train and validation."""
    return triples_prompt_dataset(make_arithmetic_dataset(n, seed, tiers), tokenizer, template, max_prompt_length,
                                  source=f"arithmetic(n={n}, seed={seed})")


def triples_prompt_dataset(triples: Sequence[tuple[str, str, int]], tokenizer: TextEncoder, template: str,
                           max_prompt_length: int, source: str) -> PromptDataset:
    """A PromptDataset of ``(question, answer, tier)`` triples (qid = index, data_source ``arithmetic/tier<k>``)."""
    return prompt_dataset_from_pairs([(q, a, f"arithmetic/tier{t}") for q, a, t in triples], tokenizer=tokenizer,
                                     template=template, max_prompt_length=max_prompt_length, source=source)


SPLITS = ("train", "val", "test")


def arithmetic_split_datasets(cfg_data, seed: int, tokenizer: TextEncoder) -> dict[str, PromptDataset]:
    """The synthetic task's splits from the ``data`` config: ``train`` (num_train_examples), ``val``
    (num_val_examples) and ``test`` (num_test_examples, only when > 0).

    With the demo's tiers (``ALL_TIERS``) train and val are the historical independent draws (seeds ``seed`` and
    ``seed + 7919``, repeats allowed, kept so the demo's numbers and caches stay valid) and test is drawn with
    seed ``seed + 15485863``; with any other tier set all splits are disjoint DISTINCT questions
    (:func:`make_arithmetic_splits`)."""
    d, tiers = cfg_data, tuple(int(t) for t in cfg_data.arithmetic_tiers)
    kw = dict(tokenizer=tokenizer, template=d.template, max_prompt_length=d.max_prompt_length)
    if tiers == ALL_TIERS:
        out = {"train": build_arithmetic_prompt_dataset(d.num_train_examples, seed, tiers=tiers, **kw),
               "val": build_arithmetic_prompt_dataset(d.num_val_examples, seed + 7919, tiers=tiers, **kw)}
        if d.num_test_examples > 0:
            out["test"] = build_arithmetic_prompt_dataset(d.num_test_examples, seed + 15485863, tiers=tiers, **kw)
        return out
    sizes = (d.num_train_examples, d.num_val_examples, d.num_test_examples)
    splits = make_arithmetic_splits(sizes, seed, tiers)
    return {name: triples_prompt_dataset(triples, source=f"arithmetic/{name}(tiers={list(tiers)}, seed={seed})", **kw)
            for name, triples, n in zip(SPLITS, splits, sizes, strict=True) if name != "test" or n > 0}


def warm_start_examples(n: int, seed: int, tiers: Sequence[int] = ALL_TIERS,
                        template: str = "plain") -> list[tuple[str, str]]:
    """Supervised warm-start corpus: ``(prompt_text, solution_text)`` pairs for the demo's SFT phase."""
    return [(render_prompt(q, template), solution_text(q, a)) for q, a, _ in make_arithmetic_dataset(n, seed, tiers)]
