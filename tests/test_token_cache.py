"""Tokenised prompt data cached on disk (data/token_cache.py): on 2 gloo ranks rank 0 tokenises and the other
rank only reads; a second start tokenises nothing and loads the same dataset; any change of file content,
tokenizer, template or max_prompt_length is a new key; a stale or foreign entry is never read."""

from __future__ import annotations

import json
import os

import pytest

from exgrpo_megatron.data.datasets import load_prompt_dataset
from exgrpo_megatron.data.token_cache import cache_key, cached_prompt_dataset, load_entry, tokenizer_fingerprint
from exgrpo_megatron.data.tokenizer import CharTokenizer, load_tokenizer, qwen_tokenizer_dir
from tests.helpers.multirank import run_on_ranks


class CountingCharTokenizer(CharTokenizer):
    """The real CharTokenizer, counting encode() calls (proof of who tokenised)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return super().encode(text)


def _write_rows(path, n: int, bad_every: int = 7) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            if i % bad_every == 3:
                fh.write("{not json\n")  # malformed rows are reported, and the cache keeps the report
            else:
                fh.write(json.dumps({"prompt": f"What is {i} + {i % 5}?" + " pad" * (i % 11), "data_source": "t",
                                     "reward_model": {"ground_truth": str(i + i % 5)}}) + "\n")


def _as_tuple(ds):
    return ([(e.qid, e.question, e.answer, e.prompt_ids, e.data_source) for e in ds], ds.stats, ds.malformed)


def _two_starts(data: str, cache_dir: str) -> dict:
    import torch.distributed as dist

    from exgrpo_megatron.distributed.runtime import init_distributed

    init_distributed(seed=3)
    kw = dict(cache_dir=cache_dir, template="plain", max_prompt_length=40)
    first_tok, second_tok = CountingCharTokenizer(), CountingCharTokenizer()
    first = cached_prompt_dataset(data, tokenizer=first_tok, **kw)
    dist.barrier()
    second = cached_prompt_dataset(data, tokenizer=second_tok, **kw)  # a second start
    return {"rank": dist.get_rank(), "first_calls": first_tok.calls, "second_calls": second_tok.calls,
            "first": _as_tuple(first), "second": _as_tuple(second)}


def test_rank0_builds_the_other_rank_reads_and_a_second_start_tokenises_nothing(tmp_path):
    data, cache_dir = str(tmp_path / "rows.jsonl"), str(tmp_path / "cache")
    _write_rows(data, 60)
    r0, r1 = run_on_ranks(_two_starts, 2, args=(data, cache_dir))
    plain = load_prompt_dataset(data, tokenizer=CharTokenizer(), template="plain", max_prompt_length=40)
    assert plain.stats.num_malformed > 0 and plain.stats.num_too_long > 0 and len(plain) > 0
    assert r0["first_calls"] == plain.stats.num_rows - plain.stats.num_malformed  # rank 0 tokenised every row
    assert r1["first_calls"] == 0 and r0["second_calls"] == 0 and r1["second_calls"] == 0
    for r in (r0, r1):
        assert r["first"] == r["second"] == _as_tuple(plain)  # examples, stats and malformed report identical
    assert len(os.listdir(cache_dir)) == 1


def test_key_follows_file_content_tokenizer_template_and_length(tmp_path):
    data = tmp_path / "rows.jsonl"
    _write_rows(data, 20)
    tok = CharTokenizer()
    base = dict(template="plain", prompt_key="prompt", answer_key="reward_model.ground_truth", max_prompt_length=40)
    key = cache_key([str(data)], tok, **base)
    assert cache_key([str(data)], CharTokenizer(), **base) == key  # stable across processes / instances
    assert cache_key([str(data)], tok, **{**base, "template": "own"}) != key
    assert cache_key([str(data)], tok, **{**base, "max_prompt_length": 41}) != key
    assert cache_key([str(data)], tok, **{**base, "answer_key": "answer"}) != key
    hf_dir = qwen_tokenizer_dir()
    if hf_dir is not None:
        assert tokenizer_fingerprint(load_tokenizer("hf", hf_dir)) != tokenizer_fingerprint(tok)
    os.utime(data, (1, 1))  # the same bytes, another mtime: the same key
    assert cache_key([str(data)], tok, **base) == key
    with open(data, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"prompt": "one more?", "reward_model": {"ground_truth": "1"}}) + "\n")
    assert cache_key([str(data)], tok, **base) != key

    cache = tmp_path / "cache"
    ds = cached_prompt_dataset(str(data), cache_dir=str(cache), tokenizer=tok, template="plain", max_prompt_length=40)
    assert len(ds) > 0
    counting = CountingCharTokenizer()
    again = cached_prompt_dataset(str(data), cache_dir=str(cache), tokenizer=counting, template="plain",
                                  max_prompt_length=60)  # another length limit: a new entry, tokenised again
    assert counting.calls > 0 and len(again) > len(ds)
    assert len(os.listdir(cache)) == 2
    entry = next(p for p in cache.iterdir())
    with pytest.raises(ValueError, match="expected"):
        load_entry(str(entry), "another-key")


def test_no_cache_dir_loads_directly(tmp_path):
    data = tmp_path / "rows.jsonl"
    _write_rows(data, 10)
    counting = CountingCharTokenizer()
    ds = cached_prompt_dataset(str(data), cache_dir="", tokenizer=counting, template="plain", max_prompt_length=40)
    assert counting.calls > 0 and len(ds) > 0 and not (tmp_path / ".cache").exists()
