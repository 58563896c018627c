"""From graded rollout groups to the tensors the policy trains on: `RolloutRows`, then the `TrainBatch`.

One row per sample: prompt + response tokens, the sequence's group advantage (broadcast over its
response tokens), the behaviour log-probs (of the policy that generated the response: the engine's, or for a
replayed trajectory its recorded ones) and a replay flag -- the `RolloutRows`, built from the graded groups. The
`TrainBatch` is those rows with their pi_old (policy/old_logprobs.py: a forward pass of the current weights,
`token_stats`, or the rollout's own exact log-probs), built in one piece once pi_old is known. Both are frozen.
`micro_batches_for_update` turns rows of a `TrainBatch` into micro-batches whose `LossInputs` the loss reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from exgrpo_megatron.policy.batch import LossInputs, MicroBatch, make_micro_batches, scatter_rows
from exgrpo_megatron.policy.objective import token_stats_fn
from exgrpo_megatron.policy.policy import Policy
from exgrpo_megatron.rollout.types import Sample


@dataclass(frozen=True)
class RolloutRows:
    """This rank's rows of one step, group by group (rows of group g are adjacent), as the rollout left them."""

    sequences: list[list[int]]  # prompt + response token ids
    prompt_lengths: list[int]
    behaviour_logprobs: list[torch.Tensor]  # per response token: the engine's; replayed rows: the recorded pi_past
    rewards: list[float]
    advantages: list[float]  # per sequence (group-relative)
    is_replay: list[bool]
    group_index: list[int]  # the row's group among this rank's groups
    # MoE: the experts the engine routed each fed token to (rollout/types.Sample); None: none recorded
    expert_choices: list[np.ndarray | None] | None = field(default=None, kw_only=True)

    @cached_property  # works on a frozen dataclass (it writes the instance __dict__; no __slots__ here)
    def response_lengths(self) -> list[int]:
        """Built once (the rows are fixed once built): callers index it per row."""
        return [len(s) - p for s, p in zip(self.sequences, self.prompt_lengths, strict=True)]

    def rows_of_groups(self, groups: set[int]) -> list[int]:
        """The rows of the given groups, in row order."""
        return [i for i, g in enumerate(self.group_index) if g in groups]


@dataclass(frozen=True)
class TrainBatch(RolloutRows):
    """The rollout rows with their pi_old: everything the step's updates read."""

    old_logprobs: list[torch.Tensor] | None  # pi_old per response token; None: the update's own forward, detached

    def __post_init__(self) -> None:
        if self.old_logprobs is not None and len(self.old_logprobs) != len(self.sequences):
            raise ValueError(f"pi_old of {len(self.old_logprobs)} rows for a batch of {len(self.sequences)}")

    @classmethod
    def of(cls, rows: RolloutRows, old_logprobs: list[torch.Tensor] | None) -> TrainBatch:
        """`rows` with their pi_old."""
        return cls(**{f.name: getattr(rows, f.name) for f in fields(RolloutRows)}, old_logprobs=old_logprobs)


def build_rollout_rows(groups: list[list[Sample]], rewards: list[list[float]],
                       advantages: Callable[[torch.Tensor], torch.Tensor]) -> RolloutRows:
    """The rows of the graded groups; `advantages`: the algorithm's ([G, K] float64 rewards -> [G, K])."""
    seqs, plens, lps, rs, advs, replay, gidx = [], [], [], [], [], [], []
    experts: list[np.ndarray | None] = []
    for g, (samples, r) in enumerate(zip(groups, rewards, strict=True)):
        a = advantages(torch.tensor([r], dtype=torch.float64))[0].tolist()
        for s, ri, ai in zip(samples, r, a, strict=True):
            seqs.append(list(s.prompt_ids) + list(s.response_ids))
            plens.append(len(s.prompt_ids))
            lps.append(torch.tensor(s.logprobs, dtype=torch.float32))
            rs.append(float(ri))
            advs.append(float(ai))
            replay.append(bool(s.is_replay))
            gidx.append(g)
            experts.append(s.expert_choices)
    recorded = any(e is not None for e in experts)
    return RolloutRows(seqs, plens, lps, rs, advs, replay, gidx, expert_choices=experts if recorded else None)


class TokenStats(NamedTuple):
    logprobs: list[torch.Tensor]  # per row, at `temperature`
    entropy: list[torch.Tensor] | None  # per row, at `temperature` (with_entropy)
    logprobs_at: list[torch.Tensor] | None  # per row, at `logprob_temperature` (when given)


def token_stats(policy: Policy, sequences: list[list[int]], prompt_lengths: list[int], *, site: str,
                temperature: float, with_entropy: bool, max_tokens: int, logprob_temperature: float | None = None,
                expert_choices: list[np.ndarray | None] | None = None) -> TokenStats:
    """Per-row log-probs (and entropies) of the response tokens under the current weights, one forward pass (the
    policy's pass `site`; every rank calls it, with no rows too: distributed/lockstep.py); with `logprob_temperature`,
    also the log-probs at that temperature from the same logits; `expert_choices`: the rows' recorded MoE routing
    (replayed as in the updates). A scoring pass: the policy runs in eval mode (LoRA's dropout off, as when the engine
    samples); the updates switch it back to training mode (update_policy)."""
    policy.eval()
    keys = ["logprobs"] + (["entropy"] if with_entropy else [])
    keys += ["logprobs_at"] if logprob_temperature is not None else []
    lengths = [len(s) for s in sequences]
    mbs = make_micro_batches(sequences, prompt_lengths, list(range(len(sequences))), max_tokens,
                             policy.sequence_packing)
    with_expert_choices(mbs, expert_choices)
    stats_fn = token_stats_fn(temperature, with_entropy, policy.model_cfg.vocab_size, logprob_temperature)
    out = policy.forward_backward(mbs, stats_fn, forward_only=True, site=site)
    got = {k: scatter_rows([o[k] for o in out], mbs, lengths, prompt_lengths) for k in keys}
    return TokenStats(got["logprobs"], got.get("entropy"), got.get("logprobs_at"))


def micro_batches_for_update(batch: TrainBatch, rows: list[int], max_tokens: int, packed: bool = False,
                             measure_mismatch: bool = False) -> list[MicroBatch]:
    """Token-budget micro-batches of the given rows, each with its `LossInputs` placed per target token
    (`measure_mismatch`: the loss also measures the engine-vs-trainer mismatch; the weights must be pi_old's)."""
    lengths = batch.response_lengths
    advantages = [torch.full((n,), a) for n, a in zip(lengths, batch.advantages, strict=True)]
    replay = [torch.full((n,), float(r)) for n, r in zip(lengths, batch.is_replay, strict=True)]
    mbs = make_micro_batches(batch.sequences, batch.prompt_lengths, rows, max_tokens, packed)
    with_expert_choices(mbs, batch.expert_choices)
    for mb in mbs:
        old = None if batch.old_logprobs is None else mb.place(batch.old_logprobs)
        mb.loss_inputs = LossInputs(old, mb.place(batch.behaviour_logprobs),
                                    mb.place(advantages), mb.place(replay), measure_mismatch)
    return mbs


def with_expert_choices(mbs: list[MicroBatch], per_row: list[np.ndarray | None] | None) -> None:
    """Give each micro-batch its rows' recorded expert choices (`per_row` indexed like the batch's rows)."""
    if per_row is not None:
        for mb in mbs:
            mb.expert_choices = [per_row[r] for r in mb.rows]
