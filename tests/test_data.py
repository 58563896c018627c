"""Prompt datasets (parquet / JSONL / JSON), the resumable PromptSampler and the synthetic arithmetic task."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exgrpo_megatron.data.datasets import load_prompt_dataset, prompt_dataset_from_pairs
from exgrpo_megatron.data.sampler import PromptSampler, SamplerExhausted
from exgrpo_megatron.data.synthetic import (
    ALL_TIERS,
    build_arithmetic_prompt_dataset,
    make_arithmetic_dataset,
    solution_text,
    warm_start_examples,
)
from exgrpo_megatron.data.tokenizer import CharTokenizer


class ByteTokenizer:
    """A trivial tokenizer: one id per UTF-8 byte (the dataset only needs ``encode``)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Be careful."}, {"role": "user", "content": question}]


# ----------------------------------------------------------------------------------------- datasets
def test_parquet_chat_prompts_nested_answer_key(tmp_path):
    rows = [
        {"data_source": "openr1", "prompt": _chat("What is 1+1?"), "reward_model": {"ground_truth": "2", "style": "r"}},
        {"data_source": "aime24", "prompt": _chat("Compute 2*3."), "reward_model": {"ground_truth": "6", "style": "r"}},
        {"data_source": "openr1", "prompt": _chat("x" * 50), "reward_model": {"ground_truth": "7", "style": "r"}},
    ]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    tok = CharTokenizer()
    ds = load_prompt_dataset([path], prompt_key="prompt", answer_key="reward_model.ground_truth", tokenizer=tok,
                             template="plain", max_prompt_length=20)
    assert ds.qids() == [0, 1]  # row 2 ("x"*50 + 4 template tokens) is too long
    assert ds.stats.num_rows == 3 and ds.stats.num_kept == 2 and ds.stats.num_too_long == 1
    assert ds.stats.num_malformed == 0 and ds.malformed == []
    ex = ds[1]
    assert (ex.qid, ex.question, ex.answer, ex.data_source) == (1, "Compute 2*3.", "6", "aime24")
    assert ex.prompt_ids == tok.encode("Compute 2*3.\n<think>\n")
    assert len(ds) == 2 and 2 not in ds
    with pytest.raises(KeyError):
        ds[2]


def test_jsonl_malformed_rows_reported_and_skipped(tmp_path, caplog):
    lines = [
        json.dumps({"prompt": "What is 3+4?", "answer": {"value": "7"}}),
        json.dumps({"prompt": "no answer here", "other": 1}),  # row 1: missing field
        "{not json",  # row 2: decode error
        json.dumps({"prompt": "What is 5?", "answer": {"value": ""}}),  # row 3: empty answer
        json.dumps({"prompt": 17, "answer": {"value": "1"}}),  # row 4: wrong prompt type
        json.dumps({"prompt": "Ints are fine", "answer": {"value": 12}}),  # row 5: kept, answer "12"
        json.dumps({"prompt": [{"role": "system", "content": "s"}], "answer": {"value": "1"}}),  # row 6: no user
        json.dumps({"prompt": "List answer", "answer": {"value": ["1"]}}),  # row 7: wrong answer type
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="exgrpo_megatron.data.datasets"):
        ds = load_prompt_dataset(str(path), prompt_key="prompt", answer_key="answer.value", tokenizer=ByteTokenizer(),
                                 template="plain", max_prompt_length=1000)
    assert ds.qids() == [0, 5]
    assert ds[5].answer == "12" and ds[0].answer == "7"
    rows = [(f, r) for f, r, _ in ds.malformed]
    assert rows == [(str(path), r) for r in (1, 2, 3, 4, 6, 7)]
    reasons = {r: reason for _, r, reason in ds.malformed}
    assert "missing field 'answer'" in reasons[1]
    assert "JSON decode error (line 3)" in reasons[2]
    assert "empty answer" in reasons[3]
    assert "type int" in reasons[4]
    assert "without a user turn" in reasons[6]
    assert "type list" in reasons[7]
    assert ds.stats.num_malformed == 6 and ds.stats.num_rows == 8 and ds.stats.num_kept == 2
    assert any(f"{path} row 2" in rec.getMessage() for rec in caplog.records)


def test_qids_are_global_row_positions_across_files(tmp_path):
    first = tmp_path / "a.json"
    first.write_text(json.dumps([{"q": "one", "a": "1"}, {"q": "two", "a": "2"}, {"q": "three", "a": "3"}]))
    second = tmp_path / "b.parquet"
    pq.write_table(pa.table({"q": ["four", "five"], "a": ["4", "5"]}), str(second))
    third = tmp_path / "c.jsonl"
    third.write_text(json.dumps({"q": "six", "a": "6"}) + "\n\n" + json.dumps({"q": "seven", "a": "7"}) + "\n")
    ds = load_prompt_dataset([str(first), str(second), str(third)], prompt_key="q", answer_key="a",
                             tokenizer=ByteTokenizer(), template="plain", max_prompt_length=100)
    # JSONL row = line index; the blank line keeps its index (qid 6) without a row.
    assert {q: ds[q].question for q in ds.qids()} == {0: "one", 1: "two", 2: "three", 3: "four", 4: "five",
                                                       5: "six", 7: "seven"}
    assert ds.stats.files == [str(first), str(second), str(third)]
    # Filtering more leaves gaps; it never renumbers.
    short = load_prompt_dataset([str(first), str(second), str(third)], prompt_key="q", answer_key="a",
                                tokenizer=ByteTokenizer(), template="plain", max_prompt_length=len("four\n<think>\n"))
    assert short.qids() == [0, 1, 3, 4, 5]
    assert short.stats.num_too_long == 2


def test_missing_column_and_unknown_type_raise(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"question": ["q"], "a": ["1"]}), str(path))
    with pytest.raises(ValueError, match="no column 'prompt'"):
        load_prompt_dataset(str(path), prompt_key="prompt", answer_key="a", tokenizer=ByteTokenizer(),
                            template="plain", max_prompt_length=10)
    other = tmp_path / "x.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown data file type"):
        load_prompt_dataset(str(other), prompt_key="prompt", answer_key="a", tokenizer=ByteTokenizer(),
                            template="plain", max_prompt_length=10)
    with pytest.raises(FileNotFoundError):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"), prompt_key="p", answer_key="a", tokenizer=ByteTokenizer(),
                            template="plain", max_prompt_length=10)


def test_literal_dotted_column_name(tmp_path):
    path = tmp_path / "flat.jsonl"
    path.write_text(json.dumps({"prompt": "q?", "reward_model.ground_truth": "5"}) + "\n")
    ds = load_prompt_dataset(str(path), prompt_key="prompt", answer_key="reward_model.ground_truth",
                             tokenizer=ByteTokenizer(), template="own", max_prompt_length=10_000)
    assert ds[0].answer == "5"
    assert bytes(ds[0].prompt_ids).decode().endswith("User: This is the problem: q? Assistant: <think>\n")


# ----------------------------------------------------------------------------------------- sampler
def test_sampler_first_epoch_matches_seeded_permutation_and_is_deterministic():
    qids = list(range(100, 130))
    sampler = PromptSampler(qids, seed=7)
    got = sampler.draw(30, skip=set())
    expected = [qids[i] for i in np.random.default_rng([7, 0]).permutation(30)]
    assert got == expected
    a, b, c = PromptSampler(qids, seed=7), PromptSampler(qids, seed=7), PromptSampler(qids, seed=8)
    seq_a = [a.draw(n) for n in (3, 11, 7, 13, 5)]
    seq_b = [b.draw(n) for n in (3, 11, 7, 13, 5)]
    seq_c = [c.draw(n) for n in (3, 11, 7, 13, 5)]
    assert seq_a == seq_b and seq_a != seq_c
    unshuffled = PromptSampler(qids, seed=7, shuffle=False)
    assert unshuffled.draw(30) == qids and unshuffled.draw(2) == qids[:2]


def _epoch_counts(draws: list[list[int]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for draw in draws:
        for q in draw:
            counts[q] = counts.get(q, 0) + 1
    return counts


def test_sampler_every_id_once_per_epoch_no_repeats_within_draw():
    qids = list(range(20))
    sampler = PromptSampler(qids, seed=3)
    draws = [sampler.draw(4) for _ in range(25)]  # 4 divides 20: exactly 5 full epochs
    flat = [q for d in draws for q in d]
    for e in range(5):
        block = flat[20 * e: 20 * (e + 1)]
        assert sorted(block) == qids
        assert block == [qids[i] for i in np.random.default_rng([3, e]).permutation(20)]
    # Draw sizes that do not divide the epoch: distinct within every draw, balanced counts overall.
    sampler = PromptSampler(qids, seed=11)
    draws = [sampler.draw(7) for _ in range(40)]  # 280 ids = 14 epochs
    assert all(len(set(d)) == 7 for d in draws)
    assert set(_epoch_counts(draws).values()) == {14}


def test_sampler_boundary_deferral_keeps_once_per_epoch():
    # Find a seed whose epoch-1 order starts with an id drawn at the end of epoch 0 in the same draw.
    qids = list(range(6))
    for seed in range(200):
        sampler = PromptSampler(qids, seed=seed)
        first = sampler.draw(4)
        second = sampler.draw(4)  # 2 from epoch 0, 2 from epoch 1
        if sampler.state_dict()["deferred"]:
            break
    else:
        pytest.fail("no seed produced a deferral")
    deferred = sampler.state_dict()["deferred"]
    assert len(set(second)) == 4 and not set(deferred) & set(second[2:])
    assert set(deferred) <= set(second[:2])
    third = sampler.draw(2)
    assert third[: len(deferred)] == deferred  # deferred ids come first
    # epoch 1 = second[2:] + third + ... : each id exactly once.
    rest = sampler.draw(6 - 2 - 2)
    epoch1 = second[2:] + third + rest
    assert sorted(epoch1) == qids and sorted(first + second[:2]) == qids


def test_sampler_skip_set_respected():
    qids = list(range(50))
    retired = set(range(0, 50, 3))
    sampler = PromptSampler(qids, seed=5)
    draws = [sampler.draw(6, skip=retired) for _ in range(33)]  # 198 = 6 epochs of 33 usable ids
    assert not {q for d in draws for q in d} & retired
    assert set(_epoch_counts(draws).values()) == {6}
    assert all(len(set(d)) == 6 for d in draws)


def test_sampler_exhausted_raises_without_changing_state():
    sampler = PromptSampler(list(range(5)), seed=0)
    sampler.draw(2)
    before = sampler.state_dict()
    with pytest.raises(SamplerExhausted, match="only 2 of 5 are not retired"):
        sampler.draw(3, skip={0, 1, 2})
    assert sampler.state_dict() == before
    assert len(sampler.draw(2, skip={0, 1, 2})) == 2


def test_sampler_resume_is_exact_mid_epoch_and_across_boundaries():
    qids = list(range(3, 40))  # 37 ids
    sizes = [5, 9, 3, 12, 7, 8, 11, 4, 6, 10, 9, 13, 2, 7, 8, 5, 12]

    def retired_at(i: int) -> set[int]:  # the retired set grows over the run
        return set(range(3, 3 + i, 2))

    for seed in range(100):  # a seed whose run passes through a state with deferred ids
        reference = PromptSampler(qids, seed=seed)
        ref_draws, states = [], []
        for i, n in enumerate(sizes):
            states.append(json.loads(json.dumps(reference.state_dict())))
            ref_draws.append(reference.draw(n, skip=retired_at(i)))
        if any(s["deferred"] for s in states):
            break
    else:
        pytest.fail("no seed produced a deferred state")
    assert reference.epoch >= 3
    assert sum(0 < s["position"] for s in states) >= 10  # most resumes are mid-epoch
    for cut in range(1, len(sizes)):
        resumed = PromptSampler(qids, seed=seed)
        resumed.load_state_dict(states[cut])
        cont = [resumed.draw(n, skip=retired_at(i)) for i, n in enumerate(sizes) if i >= cut]
        assert cont == ref_draws[cut:], f"resume at draw {cut} diverged"


def test_sampler_state_mismatch_is_rejected():
    state = PromptSampler(list(range(10)), seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(list(range(10)), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="qids_fingerprint"):
        PromptSampler(list(range(1, 11)), seed=1).load_state_dict(state)
    loose = PromptSampler(list(range(1, 11)), seed=1)
    loose.load_state_dict(state, strict=False)
    assert len(loose.draw(3)) == 3


# ----------------------------------------------------------------------------------------- synthetic task
ALLOWED = re.compile(r"^[0-9+\-*()=? a-zA-Z]+$")


def test_arithmetic_dataset_deterministic_spread_and_correct():
    data = make_arithmetic_dataset(400, seed=9)
    assert data == make_arithmetic_dataset(400, seed=9)
    assert data != make_arithmetic_dataset(400, seed=10)
    tiers = [t for _, _, t in data]
    assert {t: tiers.count(t) for t in ALL_TIERS} == {0: 100, 1: 100, 2: 100, 3: 100}
    assert tiers[:8] != sorted(tiers[:8])  # shuffled, not blocked
    tok = CharTokenizer()
    for question, answer, tier in data:
        assert ALLOWED.match(question), question
        assert tok.unk_token_id not in tok.encode(question)
        expression = question.removesuffix("=?")
        assert answer == str(int(eval(expression, {"__builtins__": {}})))  # independent reference
        pattern = {0: r"\d\+\d", 1: r"\d-\d", 2: r"\d\*\d", 3: r"\d\+\d\+\d"}[tier]
        assert re.fullmatch(pattern, expression), (tier, expression)
    assert any(a.startswith("-") for _, a, _ in data)
    assert len({q for q, _, t in data if t == 3}) > 80  # tier 3 is not a handful of repeats
    assert {t for _, _, t in make_arithmetic_dataset(30, seed=1, tiers=(2,))} == {2}


def test_solution_text_format_and_errors():
    assert solution_text("3+4*5=?", "23") == "4*5=20, 3+20=23</think>\\boxed{23}"
    assert solution_text("(3+4)*5=?", "35") == "3+4=7, 7*5=35</think>\\boxed{35}"
    assert solution_text("12-30=?", "-18") == "12-30=-18</think>\\boxed{-18}"
    with pytest.raises(ValueError, match="wrong"):
        solution_text("3+4=?", "8")
    for question, answer, _ in make_arithmetic_dataset(400, seed=2):
        assert len(solution_text(question, answer)) <= 40


def test_solution_text_graded_correct_by_real_grader():
    from exgrpo_megatron.reward.grader import score_response

    data = make_arithmetic_dataset(24, seed=4)
    assert {t for _, _, t in data} == set(ALL_TIERS)
    for question, answer, _ in data:
        solution = solution_text(question, answer)
        assert score_response(solution, answer, require_think=True, timeout_seconds=5) == 1.0, solution
        wrong = solution.replace(f"\\boxed{{{answer}}}", f"\\boxed{{{int(answer) + 1}}}")
        assert score_response(wrong, answer, require_think=True, timeout_seconds=5) == 0.0
    corpus = warm_start_examples(24, seed=4)
    assert corpus == [(f"{q}\n<think>\n", solution_text(q, a)) for q, a, _ in data]


def test_build_arithmetic_prompt_dataset():
    tok = CharTokenizer()
    ds = build_arithmetic_prompt_dataset(64, seed=3, tokenizer=tok, template="plain", max_prompt_length=32)
    triples = make_arithmetic_dataset(64, seed=3)
    assert ds.qids() == list(range(64)) and ds.stats.num_too_long == 0
    for qid, (question, answer, tier) in enumerate(triples):
        ex = ds[qid]
        assert (ex.question, ex.answer, ex.data_source) == (question, answer, f"arithmetic/tier{tier}")
        assert ex.prompt_ids == tok.encode(question + "\n<think>\n")
    # A tight limit filters and counts the long (tier 3) prompts.
    tight = build_arithmetic_prompt_dataset(64, seed=3, tokenizer=tok, max_prompt_length=8)
    n_long = sum(len(q) + 3 > 8 for q, _, _ in triples)
    assert n_long > 0 and tight.stats.num_too_long == n_long and len(tight) == 64 - n_long


def test_prompt_dataset_from_pairs_rejects_empty_answer():
    ds = prompt_dataset_from_pairs([("a?", "1"), ("b?", " ")], tokenizer=ByteTokenizer(), template="plain",
                                   max_prompt_length=100)
    assert ds.qids() == [0] and ds.malformed[0][1] == 1
