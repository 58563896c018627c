"""Pure sampling math: counter-based uniforms, temperature/top-k/top-p draws, stop detection.

Randomness is counter-based: the uniform for sample row r at decode step t is a hash of
(row seed, t) computed with exact Python integers (SplitMix64, Steele et al. 2014). It does not
depend on which other rows share the batch, the batch size, the device, or the TP/PP layout, and
it needs no generator state to broadcast. A token is drawn by inverse-CDF on the kept
probabilities, so equal logits + equal uniform give the same token on every rank.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64 finaliser: a bijective 64-bit mix (Steele, Lea, Flood 2014)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_seed(call_seed: int, request_seed: int, sample_index: int) -> int:
    """Seed of sample `sample_index` of a request: hash chain of the three integers."""
    h = splitmix64(call_seed & _MASK64)
    h = splitmix64(h ^ (request_seed & _MASK64))
    return splitmix64(h ^ (sample_index & _MASK64))


def uniform(seed: int, step: int) -> float:
    """U[0, 1) with 53 random bits from hash(seed, step)."""
    return (splitmix64(seed ^ splitmix64(step)) >> 11) * (1.0 / (1 << 53))


PAD_LOGIT = -1e30  # finite: 0 * PAD_LOGIT = 0 in entropy sums (-inf gives NaN); exp(PAD_LOGIT - max) == 0.0 exactly


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, vocab_start: int = 0) -> torch.Tensor:
    """Give megatron's padded vocabulary ids (>= vocab_size; the vocab is padded to a multiple of
    make_vocab_size_divisible_by) no probability: their logits become PAD_LOGIT. `logits` [..., V']
    hold ids vocab_start..vocab_start+V'-1 (a TP shard, or the full gathered vocab with start 0).
    The one masking used by the rollout engine and the trainer's objective (policy/objective.py),
    so their log-probs agree; the input is never modified."""
    width = logits.size(-1)
    if vocab_start + width <= vocab_size:
        return logits
    ids = torch.arange(vocab_start, vocab_start + width, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, PAD_LOGIT)


def sample_tokens(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B, V]; return (tokens [B] int64, log-probs [B] fp32).

    Distribution: p = softmax(logits / T); top-k keeps the k most probable ids, top-p keeps the
    smallest prefix (by descending p) whose mass reaches top_p; the draw is inverse-CDF on the kept
    mass with `uniforms` [B]. The returned log-prob is log p[token] under the FULL temperature
    -scaled distribution (not renormalised over the kept set). T == 0 is greedy (argmax) and
    returns log_softmax(logits)[token].
    """
    logits = logits.float()
    if temperature == 0.0:
        logp_all = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    # x / 1.0 == x exactly: no pass over the logits at T = 1. The CDFs are fp64 sums of the fp32 probabilities,
    # cast inside cumsum (dtype=) rather than by a separate fp64 copy of the [B, V] probabilities: the same sums.
    logp_all = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    probs = logp_all.exp()
    target = uniforms.to(device=logits.device, dtype=torch.float64)[:, None]
    if top_k > 0 or top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if top_k > 0:
            keep[:, top_k:] = False
        if top_p < 1.0:
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            keep &= mass_before < top_p  # the most probable token always stays
        cdf = torch.cumsum(torch.where(keep, sorted_probs, 0.0), dim=-1, dtype=torch.float64)
        pick = torch.searchsorted(cdf, target * cdf[:, -1:], right=True).clamp_(max=cdf.size(-1) - 1)
        tokens = order.gather(-1, pick).squeeze(-1)
    else:
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        tokens = torch.searchsorted(cdf, target * cdf[:, -1:], right=True).clamp_(max=cdf.size(-1) - 1).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


def find_stop_string(decode, response_ids: list[int], stop_strings: list[str], window_tokens: int) -> bool:
    """True when the decoded tail of the response contains a stop string.

    Called after every new token, so the first True happens at the token that completes the
    string; only the last `window_tokens` tokens are decoded (cost O(window), not O(length)).
    """
    if not stop_strings:
        return False
    text = decode(response_ids[-window_tokens:])
    return any(s in text for s in stop_strings)


def stop_window_tokens(stop_strings: list[str], margin: int = 8) -> int:
    """Tokens to decode for stop detection: a stop string of c characters spans at most c tokens
    that each decode to >= 1 character; the margin covers byte-fallback tokens that decode to ''."""
    return max((len(s) for s in stop_strings), default=0) + margin
