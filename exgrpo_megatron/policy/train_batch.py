"""From graded rollout groups to the tensors the policy trains on.

One row per sample: prompt + response tokens, the sequence's group advantage (broadcast over its
response tokens), the generation log-probs (for a replayed trajectory: its recorded behaviour
log-probs) and a replay flag. Old log-probs come from a forward pass of the current weights
(`token_stats`), or are the generation log-probs when recomputation is off.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def token_stats(policy: Policy, sequences: list[list[int]], prompt_lengths: list[int], *, temperature: float,
                with_entropy: bool, max_tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-row log-probs (and entropies) of the response tokens under the current weights."""
    if not sequences:
        return [], ([] if with_entropy else None)
    lengths = [len(s) for s in sequences]
    mbs = make_micro_batches(sequences, prompt_lengths, list(range(len(sequences))), max_tokens,
                             policy.cfg.trainer.sequence_packing)
    stats_fn = token_stats_fn(temperature, with_entropy, policy.cfg.model.vocab_size)
    out = policy.forward_backward(mbs, stats_fn, forward_only=True)
    logp = scatter_rows([o["logprobs"] for o in out], mbs, lengths, prompt_lengths)
    ent = scatter_rows([o["entropy"] for o in out], mbs, lengths, prompt_lengths) if with_entropy else None
    return logp, ent


def micro_batches_for_update(batch: RolloutBatch, rows: list[int], old_logprobs: list[torch.Tensor],
                             behaviour_logprobs: list[torch.Tensor], max_tokens: int,
                             packed: bool = False) -> list[MicroBatch]:
    """Token-budget micro-batches of the given rows with the loss extras placed per target token."""
    per_token = {
        "old_logprobs": old_logprobs,
        "behaviour_logprobs": behaviour_logprobs,
        "advantages": [torch.full((n,), a) for n, a in zip(batch.response_lengths, batch.advantages, strict=True)],
        "replay": [torch.full((n,), float(r)) for n, r in zip(batch.response_lengths, batch.is_replay, strict=True)],
    }
    return make_micro_batches(batch.sequences, batch.prompt_lengths, rows, max_tokens, packed, per_token)
