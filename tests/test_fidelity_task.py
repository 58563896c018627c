"""The fidelity preset's task: harder arithmetic tiers, distinct disjoint train/val/test
splits, a finite training set, and the demo's historical splits unchanged."""

from __future__ import annotations

import re

import pytest

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import config_errors
from exgrpo_megatron.data.synthetic import (
    ALL_TIERS,
    arithmetic_split_datasets,
    build_arithmetic_prompt_dataset,
    evaluate_with_steps,
    make_arithmetic_splits,
    question_expression,
    solution_text,
)
from exgrpo_megatron.data.tokenizer import load_tokenizer

PATTERNS = {3: r"\d\+\d\+\d", 4: r"[1-9]\d\+\d", 5: r"[1-9]\d\+[1-9]\d", 6: r"\d\*\d\+\d", 7: r"[1-9]\d-\d"}


def test_splits_are_distinct_disjoint_balanced_and_correct():
    sizes = (600, 100, 200)
    splits = make_arithmetic_splits(sizes, seed=5, tiers=(3, 4, 5, 6, 7))
    assert splits == make_arithmetic_splits(sizes, seed=5, tiers=(3, 4, 5, 6, 7))
    assert [len(s) for s in splits] == list(sizes)
    questions = [q for s in splits for q, _, _ in s]
    assert len(set(questions)) == len(questions)  # no repeat inside or across splits
    for split in splits:
        counts = {t: sum(1 for *_, tier in split if tier == t) for t in PATTERNS}
        assert max(counts.values()) - min(counts.values()) <= 1, counts
    for q, a, tier in splits[0]:
        assert re.fullmatch(PATTERNS[tier], question_expression(q)), (tier, q)
        assert str(evaluate_with_steps(question_expression(q))[0]) == a
        assert solution_text(q, a).endswith(f"\\boxed{{{a}}}")


def test_a_tier_with_too_few_questions_is_a_clear_error():
    with pytest.raises(ValueError, match="tier 0 has too few distinct questions"):
        make_arithmetic_splits((150,), seed=0, tiers=(0,))


def test_demo_tiers_keep_their_historical_train_and_val_draws():
    cfg = load_config("demo_cpu", ["data.num_train_examples=64", "data.num_val_examples=16",
                                   "data.num_test_examples=16"])
    tok = load_tokenizer("char", None)
    splits = arithmetic_split_datasets(cfg.data, cfg.seed, tok)
    assert tuple(cfg.data.arithmetic_tiers) == ALL_TIERS
    old_train = build_arithmetic_prompt_dataset(64, cfg.seed, tok)
    old_val = build_arithmetic_prompt_dataset(16, cfg.seed + 7919, tok)
    assert [e.question for e in splits["train"]] == [e.question for e in old_train]
    assert [e.question for e in splits["val"]] == [e.question for e in old_val]
    assert len(splits["test"]) == 16


def test_fidelity_preset_is_valid_and_has_a_finite_set_revisited_over_epochs():
    cfg = load_config("fidelity_cpu")
    assert config_errors(cfg, world_size=1) == []
    t, d = cfg.trainer, cfg.data
    fresh_grpo = t.total_steps * t.train_batch_size
    fresh_exgrpo_lower = t.total_steps * (t.train_batch_size - int(cfg.experience.ratio * t.train_batch_size))
    assert fresh_grpo / d.num_train_examples >= 2 and fresh_exgrpo_lower / d.num_train_examples >= 2
    assert d.num_val_examples > 0 and d.num_test_examples > 0
    assert cfg.algo.loss_seqs_per_rank_ref == 64
    splits = arithmetic_split_datasets(d, cfg.seed, load_tokenizer("char", None))
    sets = [{e.question for e in splits[name]} for name in ("train", "val", "test")]
    assert [len(s) for s in sets] == [d.num_train_examples, d.num_val_examples, d.num_test_examples]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
