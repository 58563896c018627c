"""Expert parallelism over ranks that hold different data: every rank of an expert-parallel group must run the same
number of model forwards, because each MoE layer exchanges tokens between them (the token dispatcher's all-to-all).

Our micro-batches are planned per rank by token budget, so two DP ranks of one EP group can plan different counts,
and a rank can have none at all. The ranks agree on the count (distributed/lockstep.py) and `padded_to` appends padding
micro-batches up to it: one token, no loss target (the loss and its metrics are zero), and the router's
load-balancing and z-losses switched off for its forward (`router_losses_off`), so a padding micro-batch changes no
gradient. The token count of a micro-batch may still differ between ranks: that is what the alltoall dispatcher's
split sizes carry.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from exgrpo_megatron.algo.sequences import Sequences
from exgrpo_megatron.policy.batch import LossInputs, MicroBatch


def is_padding(mb: MicroBatch) -> bool:
    return not mb.rows


def padding_micro_batch(like: MicroBatch | None, packed: bool) -> MicroBatch:
    tokens = torch.zeros((1, 1), dtype=torch.long)
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    # a rank with no micro-batch of its own: zero loss inputs (any loss reads them as a zero loss)
    inputs: LossInputs | None = LossInputs(zeros, zeros, zeros, zeros, False)
    if like is not None and like.loss_inputs is not None:
        x = like.loss_inputs
        inputs = LossInputs(None if x.old_logprobs is None else zeros, zeros, zeros, zeros, x.measure_mismatch)
    elif like is not None:
        inputs = None
    packed = like.cu_seqlens is not None if like is not None else packed
    cu = torch.tensor([0, 1], dtype=torch.int32) if packed else None
    # one row holding no sequence's token: every index -1, so a per-sequence reduction adds nothing
    return MicroBatch(tokens, zeros.clone(), Sequences.rows(zeros), [], [1], [1], cu, inputs)


def padded_to(mbs: list[MicroBatch], count: int, packed: bool) -> list[MicroBatch]:
    """`mbs` plus padding micro-batches up to `count` (the count the ranks agreed on)."""
    like = mbs[0] if mbs else None
    return mbs + [padding_micro_batch(like, packed) for _ in range(count - len(mbs))]


@contextmanager
def router_losses_off(config: Any) -> Iterator[None]:
    """No load-balancing or z-loss is attached by the MoE routers of forwards run inside (megatron reads both
    coefficients from the shared TransformerConfig at each forward)."""
    aux, z = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    config.moe_aux_loss_coeff, config.moe_z_loss_coeff = 0.0, None
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = aux, z
