"""Token-budget micro-batches of (prompt + response) sequences, right-padded or packed.

Padded: one row per sequence, [b, longest] tokens. Packed (`trainer.sequence_packing`): the sequences back to
back in one row, [1, sum of lengths], with `cu_seqlens` = [0, l_0, l_0 + l_1, ...] marking where each starts;
the model attends within each sequence only and restarts positions at each start (megatron's THD format,
`PackedSeqParams`), so a packed micro-batch computes the same per-token values as the padded one, without
the padding.

Per-token tensors are aligned to *targets*: column t describes the prediction of token t+1, so
`loss_mask[:, t]` is 1 where tokens[:, t+1] is a response token. The last column of each sequence is 0
(in a packed row its "target" is the next sequence's first token, never a loss token). `MicroBatch.sequences`
names the sequence of every response target under both layouts (algo/sequences.py), so the loss can reduce over a
sequence's tokens without knowing the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from exgrpo_megatron.algo.sequences import Sequences


@dataclass
class LossInputs:
    """What the RL loss reads per token of one micro-batch, aligned like `MicroBatch.loss_mask` (0 outside the
    response targets): pi_old, the behaviour log-probs (of the policy that generated the response: the engine's;
    on a replayed row the recorded pi_past), the sequence's advantage broadcast over its tokens and the replay flag
    (1.0 on replayed rows). `measure_mismatch`: the weights are still pi_old's, so the loss also measures the
    engine-vs-trainer mismatch on fresh tokens (the first update of a step whose pi_old was not recomputed)."""

    old_logprobs: torch.Tensor | None  # None: pi_old is the loss's own forward, detached (one update per step)
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    replay: torch.Tensor
    measure_mismatch: bool = False

    def to(self, device: torch.device) -> LossInputs:
        old = None if self.old_logprobs is None else self.old_logprobs.to(device)
        return LossInputs(old, self.behaviour_logprobs.to(device),
                          self.advantages.to(device), self.replay.to(device), self.measure_mismatch)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] int64, right-padded (or [1, sum of lengths] packed)
    loss_mask: torch.Tensor  # [b, s] float, 1 on response targets
    sequences: Sequences  # each response target's sequence (0 .. len(rows)-1), -1 elsewhere
    rows: list[int] = field(default_factory=list)  # positions of these sequences in the full batch
    lengths: list[int] = field(default_factory=list)  # token count of each row's sequence
    prompt_lengths: list[int] = field(default_factory=list)  # prompt token count of each row's sequence
    cu_seqlens: torch.Tensor | None = None  # packed: int32 [rows + 1] sequence starts; None = padded rows
    loss_inputs: LossInputs | None = None  # the RL loss's per-token inputs (None: forward-only passes)
    # MoE: each row's recorded expert choices ([tokens, layers, k]) or None (model/routing_replay.py)
    expert_choices: list[np.ndarray | None] | None = None

    @property
    def row_starts(self) -> list[tuple[int, int]]:
        """(row, column) of each sequence's first token."""
        return [self.row_start(b) for b in range(len(self.rows))]

    @property
    def labels(self) -> torch.Tensor:
        lab = torch.zeros_like(self.tokens)
        lab[:, :-1] = self.tokens[:, 1:]
        return lab

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def padding_tokens(self) -> int:
        """Token slots run through the model that belong to no sequence."""
        return self.tokens.numel() - sum(self.lengths)

    def row_start(self, b: int) -> tuple[int, int]:
        """(row, column) of the first token of this micro-batch's b-th sequence."""
        return (0, int(self.cu_seqlens[b])) if self.cu_seqlens is not None else (b, 0)

    def place(self, per_row: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One per-response-token quantity at this micro-batch's target positions, where `loss_mask` is 1 (`dtype`,
        0 elsewhere): `per_row[i]` holds the values of full-batch row i (`rows`), one per response token."""
        values = torch.cat([torch.as_tensor(per_row[i], dtype=dtype).reshape(-1) for i in self.rows])
        targets = self.loss_mask.bool()
        if values.numel() != int(targets.sum()):
            raise ValueError(f"{values.numel()} values for the {int(targets.sum())} response tokens of micro-batch "
                             f"rows {self.rows}")
        out = torch.zeros(self.tokens.shape, dtype=dtype)
        out[targets] = values  # row-major order: the rows in order, each row's targets in sequence order
        return out

    def to(self, device: torch.device) -> MicroBatch:
        cu = None if self.cu_seqlens is None else self.cu_seqlens.to(device)
        inputs = None if self.loss_inputs is None else self.loss_inputs.to(device)
        return MicroBatch(self.tokens.to(device), self.loss_mask.to(device), self.sequences.to(device),
                          list(self.rows), list(self.lengths), list(self.prompt_lengths), cu, inputs,
                          self.expert_choices)


def plan_micro_batches(lengths: list[int], max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Token-budget micro-batches; returns row indices per micro-batch, every row exactly once, a single row
    longer than the budget alone. Padded: sort by length (longest first) and fill greedily while rows x longest
    row stays within `max_tokens`. Packed: first-fit decreasing on the sum of lengths."""
    if packed:
        return _first_fit_decreasing(lengths, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for i in order:
        new_max = max(current_max, lengths[i])
        if current and new_max * (len(current) + 1) > max_tokens:
            plan.append(current)
            current, new_max = [], lengths[i]
        current.append(i)
        current_max = new_max
    if current:
        plan.append(current)
    return plan


def _first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((j for j, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if fit is None:
            bins.append([i])
            loads.append(lengths[i])
        else:
            bins[fit].append(i)
            loads[fit] += lengths[i]
    return bins


def collate(
    sequences: list[list[int]],
    prompt_lengths: list[int],
    rows: list[int],
    pad_id: int = 0,
    packed: bool = False,
) -> MicroBatch:
    """Right-pad (or pack) the selected sequences; per-token quantities go in with `MicroBatch.place`."""
    lengths = [len(sequences[i]) for i in rows]
    shape = (1, sum(lengths)) if packed else (len(rows), max(lengths))
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    seq_index = torch.full(shape, -1, dtype=torch.long)
    for b, i in enumerate(rows):
        seq, p = sequences[i], prompt_lengths[i]
        r, c = (0, starts[b]) if packed else (b, 0)
        tokens[r, c : c + len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        loss_mask[r, c + p - 1 : c + len(seq) - 1] = 1.0
        seq_index[r, c + p - 1 : c + len(seq) - 1] = b
    cu = torch.tensor(starts, dtype=torch.int32) if packed else None
    return MicroBatch(tokens, loss_mask, Sequences(seq_index, len(rows)), list(rows), lengths,
                      [prompt_lengths[i] for i in rows], cu)


def make_micro_batches(sequences: list[list[int]], prompt_lengths: list[int], rows: list[int], max_tokens: int,
                       packed: bool) -> list[MicroBatch]:
    """Plan and collate token-budget micro-batches of `rows` (indices into `sequences`)."""
    plan = plan_micro_batches([len(sequences[i]) for i in rows], max_tokens, packed)
    return [collate(sequences, prompt_lengths, [rows[j] for j in mb], packed=packed) for mb in plan]


def forward_inputs(mb: MicroBatch, causal_mask: bool) -> dict[str, Any]:
    """Keyword arguments of GPTModel.forward for one micro-batch: padded rows with positions 0..s-1 (and
    megatron's explicit causal mask when `causal_mask`), or the packed row as THD `PackedSeqParams` (per-sequence
    causal attention; RoPE positions restart at every cu_seqlens entry)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from exgrpo_megatron.model.builder import causal_attention_mask

    b, s = mb.tokens.shape
    device = mb.tokens.device
    if mb.cu_seqlens is None:
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
        mask = causal_attention_mask(s, b, device) if causal_mask else None
        return {"input_ids": mb.tokens, "position_ids": position_ids, "attention_mask": mask}
    longest = max(mb.lengths)
    position_ids = torch.cat([torch.arange(n, device=device) for n in mb.lengths]).unsqueeze(0)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return {"input_ids": mb.tokens, "position_ids": position_ids, "attention_mask": None,
            "packed_seq_params": params}


def scatter_rows(per_micro: list[torch.Tensor], micro_batches: list[MicroBatch],
                 lengths: list[int], prompt_lengths: list[int]) -> list[torch.Tensor]:
    """Inverse of `collate` for one per-token quantity: response-token values per original row, on the host (rows
    live on the CPU; `place` puts them into micro-batches there, which move to the model's device as a whole)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(lengths)
    for values, mb in zip(per_micro, micro_batches, strict=True):
        values = values.cpu()  # one copy per micro-batch; on a GPU, pi_old recomputed there failed in `place`
        for b, i in enumerate(mb.rows):
            p, n = prompt_lengths[i], lengths[i]
            r, c = mb.row_start(b)
            out[i] = values[r, c + p - 1 : c + n - 1].detach().clone()
    return out
