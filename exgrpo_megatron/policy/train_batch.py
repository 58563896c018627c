"""From graded rollout groups to the tensors the policy trains on.

One row per sample: prompt + response tokens, the sequence's group advantage (broadcast over its
response tokens), the generation log-probs (for a replayed trajectory: its recorded behaviour
log-probs) and a replay flag. Old log-probs: policy/old_logprobs.py (a forward pass of the current
weights, `token_stats`, or the rollout's own exact log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from exgrpo_megatron.algo.advantages import group_advantages
from exgrpo_megatron.policy.batch import MicroBatch, make_micro_batches, scatter_rows
from exgrpo_megatron.policy.objective import token_stats_fn
from exgrpo_megatron.policy.policy import Policy
from exgrpo_megatron.rollout.types import Sample


@dataclass
class RolloutBatch:
    sequences: list[list[int]]
    prompt_lengths: list[int]
    gen_logprobs: list[torch.Tensor]
    rewards: list[float]
    advantages: list[float]
    is_replay: list[bool]
    group_index: list[int]

    @property
    def response_lengths(self) -> list[int]:
        return [len(s) - p for s, p in zip(self.sequences, self.prompt_lengths, strict=True)]


def build_rollout_batch(groups: list[list[Sample]], rewards: list[list[float]], std_normalize: bool) -> RolloutBatch:
    seqs, plens, lps, rs, advs, replay, gidx = [], [], [], [], [], [], []
    for g, (samples, r) in enumerate(zip(groups, rewards, strict=True)):
        a = group_advantages(torch.tensor([r], dtype=torch.float64), std_normalize=std_normalize)[0].tolist()
        for s, ri, ai in zip(samples, r, a, strict=True):
            seqs.append(list(s.prompt_ids) + list(s.response_ids))
            plens.append(len(s.prompt_ids))
            lps.append(torch.tensor(s.logprobs, dtype=torch.float32))
            rs.append(float(ri))
            advs.append(float(ai))
            replay.append(bool(s.is_replay))
            gidx.append(g)
    return RolloutBatch(seqs, plens, lps, rs, advs, replay, gidx)


class TokenStats(NamedTuple):
    logprobs: list[torch.Tensor]  # per row, at `temperature`
    entropy: list[torch.Tensor] | None  # per row, at `temperature` (with_entropy)
    logprobs_at: list[torch.Tensor] | None  # per row, at `logprob_temperature` (when given)


def token_stats(policy: Policy, sequences: list[list[int]], prompt_lengths: list[int], *, temperature: float,
                with_entropy: bool, max_tokens: int, logprob_temperature: float | None = None) -> TokenStats:
    """Per-row log-probs (and entropies) of the response tokens under the current weights, one forward pass;
    with `logprob_temperature`, also the log-probs at that temperature from the same logits."""
    keys = ["logprobs"] + (["entropy"] if with_entropy else [])
    keys += ["logprobs_at"] if logprob_temperature is not None else []
    if not sequences:
        got = {k: [] for k in keys}
    else:
        lengths = [len(s) for s in sequences]
        mbs = make_micro_batches(sequences, prompt_lengths, list(range(len(sequences))), max_tokens,
                                 policy.cfg.trainer.sequence_packing)
        stats_fn = token_stats_fn(temperature, with_entropy, policy.cfg.model.vocab_size, logprob_temperature)
        out = policy.forward_backward(mbs, stats_fn, forward_only=True)
        got = {k: scatter_rows([o[k] for o in out], mbs, lengths, prompt_lengths) for k in keys}
    return TokenStats(got["logprobs"], got.get("entropy"), got.get("logprobs_at"))


def micro_batches_for_update(batch: RolloutBatch, rows: list[int], old_logprobs: list[torch.Tensor],
                             behaviour_logprobs: list[torch.Tensor], max_tokens: int,
                             packed: bool = False, with_generation_logprobs: bool = False) -> list[MicroBatch]:
    """Token-budget micro-batches of the given rows with the loss extras placed per target token
    (with_generation_logprobs: also the engine's log-probs, for the mismatch metric)."""
    per_token = {
        "old_logprobs": old_logprobs,
        "behaviour_logprobs": behaviour_logprobs,
        "advantages": [torch.full((n,), a) for n, a in zip(batch.response_lengths, batch.advantages, strict=True)],
        "replay": [torch.full((n,), float(r)) for n, r in zip(batch.response_lengths, batch.is_replay, strict=True)],
    }
    if with_generation_logprobs:
        per_token["generation_logprobs"] = batch.gen_logprobs
    return make_micro_batches(batch.sequences, batch.prompt_lengths, rows, max_tokens, packed, per_token)
