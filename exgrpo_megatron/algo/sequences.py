"""Which sequence each loss token belongs to, and reductions over the tokens of each sequence.

A micro-batch is right-padded (one sequence per row) or packed (`trainer.sequence_packing`, the default: several
sequences back to back in one row; policy/batch.py), so a row is not a sequence. `Sequences.index[b, t]` names the
sequence of response target (b, t) in the micro-batch (0 .. count-1, -1 outside the response targets) under both
layouts; a sequence-level quantity (GSPO's ratio, a per-sequence mean) is reduced with `means` / `sums` over that
index and spread back to its tokens with `to_tokens`, never with a per-row mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sequences:
    index: Tensor  # int64 [B, T]: the token's sequence in the micro-batch, -1 outside the response targets
    count: int  # sequences in the micro-batch

    @classmethod
    def rows(cls, response_mask: Tensor) -> Sequences:
        """One sequence per row (a padded batch): row b's response targets belong to sequence b."""
        b, t = response_mask.shape
        rows = torch.arange(b, device=response_mask.device).unsqueeze(-1).expand(b, t)
        return cls(torch.where(response_mask.bool(), rows, torch.full_like(rows, -1)), b)

    def to(self, device: torch.device) -> Sequences:
        return Sequences(self.index.to(device), self.count)

    def sums(self, values: Tensor, where: Tensor | None = None) -> Tensor:
        """[count] sums of `values` [B, T] over each sequence's tokens (and `where`, a bool [B, T], if given)."""
        keep = self.index >= 0 if where is None else (self.index >= 0) & where.bool()
        idx = torch.where(keep, self.index, torch.zeros_like(self.index)).reshape(-1)
        vals = torch.where(keep, values, torch.zeros_like(values)).reshape(-1)
        return torch.zeros(self.count, dtype=values.dtype, device=values.device).index_add(0, idx, vals)

    def token_counts(self, where: Tensor | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """[count] number of tokens of each sequence (within `where`, if given)."""
        return self.sums(torch.ones(self.index.shape, dtype=dtype, device=self.index.device), where)

    def means(self, values: Tensor, where: Tensor | None = None) -> Tensor:
        """[count] mean of `values` over each sequence's tokens (within `where`); 0 for a sequence with none."""
        return self.sums(values, where) / self.token_counts(where, values.dtype).clamp(min=1.0)

    def to_tokens(self, per_sequence: Tensor) -> Tensor:
        """[count] -> [B, T]: each token gets its sequence's value, 0 outside the response targets."""
        valid = self.index >= 0
        got = per_sequence[torch.where(valid, self.index, torch.zeros_like(self.index))]
        return torch.where(valid, got, torch.zeros_like(got))
