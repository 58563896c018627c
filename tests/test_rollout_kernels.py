"""Rollout building blocks as pure functions: the decode attention mask, vocab padding, token sampling against
its float64 formula, the KV cache's RoPE and attention against megatron's and float64's, the replay splice and
the request checks every engine shares."""

from __future__ import annotations

import math

import pytest
import torch

from exgrpo_megatron.rollout.sampling import sample_tokens
from exgrpo_megatron.rollout.splice import splice_replay
from exgrpo_megatron.rollout.types import Sample


def test_attention_mask_causal_padding_and_self():
    from exgrpo_megatron.rollout.kv_decode import attention_mask

    valid = torch.tensor([[False, True, True, True], [True, True, True, False]])  # row 1: key 3 not yet valid
    prefill = attention_mask(valid, 0, 3)[:, 0]  # [b, 3 queries, 3 keys], True = may attend
    assert prefill[0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]  # pad sees itself
    assert prefill[1].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    decode = attention_mask(valid, 3, 1)[:, 0, 0]  # one query at position 3
    assert decode.tolist() == [[False, True, True, True], [True, True, True, True]]


def test_vocab_padding_mask_is_one_function_for_engine_and_trainer():
    """The trainer masks each TP shard exactly as the engine masks the gathered vocabulary, and
    padded ids get zero probability (finite logit: 0 * logit stays 0 in entropy)."""
    from exgrpo_megatron.policy.output_layer import mask_vocab_padding
    from exgrpo_megatron.rollout.sampling import PAD_LOGIT, mask_padded_vocab

    logits = torch.randn(3, 128)
    full = mask_padded_vocab(logits, 100)
    shards = [mask_padded_vocab(logits[:, k * 32:(k + 1) * 32], 100, vocab_start=k * 32) for k in range(4)]
    assert torch.equal(torch.cat(shards, -1), full)
    assert torch.equal(mask_vocab_padding(logits, 100), full)  # parallel state not initialised: TP rank 0
    assert torch.equal(full[:, :100], logits[:, :100]) and (full[:, 100:] == PAD_LOGIT).all()
    assert torch.softmax(full, -1)[:, 100:].max().item() == 0.0
    assert torch.isfinite((torch.softmax(full, -1) * full).sum(-1)).all()


def test_sample_tokens_matches_filtered_distribution():
    """Frequencies of the inverse-CDF draw equal the float64 top-k / top-p renormalised p, and the
    returned log-prob is that of the full temperature-scaled distribution."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])  # already sorted: mass-before in vocab order
    n = 40000
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # stratified: near-exact frequencies
    p = torch.softmax(logits[0].double() / 0.5, -1)
    mass_before = torch.cumsum(p, 0) - p
    for top_p, top_k in [(0.9, -1), (1.0, 3), (0.99, 2), (1.0, -1)]:
        tokens, logp = sample_tokens(logits.expand(n, 5), uniforms, temperature=0.5, top_p=top_p, top_k=top_k)
        kept = torch.where(mass_before < top_p, p, 0.0)
        if top_k > 0:
            kept[top_k:] = 0.0
        kept /= kept.sum()
        freq = torch.bincount(tokens, minlength=5).double() / n
        assert torch.allclose(freq, kept, atol=1e-3), (top_p, top_k, freq, kept)
        assert torch.allclose(logp.double(), torch.log(p[tokens]), atol=1e-6)


def _sample_tokens_fp64_copy(logits, uniforms, temperature, top_p=1.0, top_k=-1):
    """The sampler as first written: logits / T, an fp64 copy of the probabilities, then their cumsum."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logp_all.exp()
    target = uniforms.double()[:, None]
    if top_k > 0 or top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if top_k > 0:
            keep[:, top_k:] = False
        keep &= torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        cdf = torch.cumsum(torch.where(keep, sorted_probs, 0.0).double(), dim=-1)
        pick = torch.searchsorted(cdf, target * cdf[:, -1:], right=True).clamp_(max=cdf.size(-1) - 1)
        tokens = order.gather(-1, pick).squeeze(-1)
    else:
        cdf = torch.cumsum(probs.double(), dim=-1)
        tokens = torch.searchsorted(cdf, target * cdf[:, -1:], right=True).clamp_(max=cdf.size(-1) - 1).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


def test_sample_tokens_draws_exactly_what_the_fp64_copy_did():
    """The sampler's shortcuts (no division at T = 1, the fp64 cast inside cumsum) draw the same tokens with the same
    log-probs, bit for bit, at the decode's shape (a SmolLM2-sized vocabulary: the CDF sums 49152 probabilities)."""
    gen = torch.Generator().manual_seed(0)
    for temperature, top_p, top_k in [(1.0, 1.0, -1), (0.7, 1.0, -1), (1.0, 0.9, 50), (0.6, 0.95, -1)]:
        logits = torch.randn(64, 49152, generator=gen) * 4
        uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
        if top_p == 1.0 and top_k <= 0:  # half the rows drawn ON a CDF boundary: one ulp of any sum moves the token
            cdf = torch.cumsum(torch.log_softmax(logits / temperature, -1).exp().double(), -1)[:32]
            at = torch.randint(0, 49152, (32, 1), generator=gen)
            uniforms[:32] = (cdf.gather(-1, at) / cdf[:, -1:]).squeeze(-1)
        got = sample_tokens(logits, uniforms, temperature, top_p, top_k)
        want = _sample_tokens_fp64_copy(logits, uniforms, temperature, top_p, top_k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (temperature, top_p, top_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_rope_is_megatrons_formula_bit_for_bit(dtype):
    """The KV-cache stage's RoPE (roll and a signed sin) equals megatron's x cos + rotate_half(x) sin exactly, on a
    non-contiguous query view as the stage gets it, with full and partial rotary dims."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    from exgrpo_megatron.rollout.kv_decode import apply_rope, signed_sin

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3, 12, 64, generator=gen).to(dtype)
    for rot in (64, 32):
        freqs = torch.randn(5, 1, 1, rot, generator=gen)
        cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
        for x in (qkv[:, :, :8], qkv[:1, :, 8:]):  # [s, b, heads, d] views of a fused projection
            head = x[..., :rot]
            want = torch.cat((head * cos[: x.shape[0]] + _rotate_half(head, False) * sin[: x.shape[0]],
                              x[..., rot:]), dim=-1)
            assert torch.equal(apply_rope(x, cos[: x.shape[0]], signed_sin(sin)[: x.shape[0]]), want), (rot, x.shape)


@pytest.mark.parametrize("path", ["cache_attention", "explicit_cache_attention", "fused_cache_attention"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_cache_attention_equals_the_float64_formula(dtype, tol, path):
    """Decode attention over the cache, both paths and the engine's choice between them (on the CPU: explicit
    matmuls in fp32, torch's fused kernel in bf16; on CUDA explicit), against float64 softmax(scale q k^T + mask) v
    with megatron's GQA grouping g(h) = h // (heads / groups), for one decode query and a prefill block with a
    causal | padding mask."""
    from exgrpo_megatron.rollout import kv_decode
    from exgrpo_megatron.rollout.kv_decode import attention_mask

    cache_attention = getattr(kv_decode, path)

    gen = torch.Generator().manual_seed(0)
    b, heads, groups, d, total = 3, 6, 2, 16, 9
    keys, values = (torch.randn(b, groups, total, d, generator=gen) for _ in range(2))
    valid = torch.ones(b, total, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    for start, s in ((total - 1, 1), (0, total)):
        q = torch.randn(s, b, heads, d, generator=gen)
        mask = attention_mask(valid, start, s)
        k, v = keys[:, :, : start + s], values[:, :, : start + s]
        group_of = torch.arange(heads) // (heads // groups)
        scores = torch.einsum("sbhd,bhtd->bhst", q.double(), k.double()[:, group_of]) * 0.25
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        want = torch.einsum("bhst,bhtd->sbhd", probs, v.double()[:, group_of]).reshape(s, b, heads * d)
        got = cache_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.25)
        assert got.dtype == dtype and (got.double() - want).abs().max() <= tol, (dtype, start)


def test_cache_attention_takes_the_fused_kernel_only_for_half_precision_off_cuda():
    from exgrpo_megatron.rollout.kv_decode import cache_attention_path

    assert cache_attention_path(torch.bfloat16, "cpu") == cache_attention_path(torch.float16, "cpu") == "fused"
    assert cache_attention_path(torch.float32, "cpu") == "explicit"
    # CUDA: enable_gqa with a mask would run torch's math kernel, which copies the cache to every query head
    assert {cache_attention_path(d, "cuda") for d in (torch.bfloat16, torch.float16, torch.float32)} == {"explicit"}


def test_splice_replay_layout():
    fresh = [Sample([1, 2], [3, 4], [-0.1, -0.2], "eos"), Sample([1, 2], [5], [-0.3], "length")]
    spliced = splice_replay(fresh, [1, 2], [7, 8, 9], [-1.0, -2.0, -3.0])
    assert len(spliced) == 3 and spliced[:2] == fresh
    replay = spliced[-1]
    assert replay.is_replay and replay.finish_reason == "replay"
    assert replay.response_ids == [7, 8, 9] and replay.logprobs == [-1.0, -2.0, -3.0]
    assert [s.is_replay for s in spliced] == [False, False, True]
    assert len(fresh) == 2
    with pytest.raises(ValueError):
        splice_replay(fresh, [1, 3], [7], [-1.0])
    with pytest.raises(ValueError):
        splice_replay(fresh, [1, 2], [7, 8], [-1.0])
    assert math.isclose(sum(replay.logprobs), -6.0)


def test_generate_requests_are_checked_the_same_way_for_every_engine():
    from exgrpo_megatron.rollout.types import request_seeds_for

    assert request_seeds_for([[1], [2, 3]], 2, None) == [0, 1]
    assert request_seeds_for([[1], [2, 3]], 1, [7, 9]) == [7, 9]
    assert request_seeds_for([[1], [2, 3]], [3, 2], None) == [0, 1]
    for prompts, n, seeds, message in (([[1]], 0, None, "n must be"), ([[1], []], 1, None, "empty prompt"),
                                       ([[1], [2]], 1, [5], "1 request seeds for 2 prompts"),
                                       ([[1], [2]], [2, 0], None, "n must be"),
                                       ([[1], [2]], [2], None, "1 sample counts for 2 prompts")):
        with pytest.raises(ValueError, match=message):
            request_seeds_for(prompts, n, seeds)
