"""The output layer fused into the chunked vocab-parallel log-prob and entropy.

logits = h W^T (h: final hidden states [N, H], W: this TP rank's vocabulary shard of the output weight
[V/tp, H], ColumnParallelLinear without bias, sequence parallelism off so h is the same on every TP rank).
Per chunk of `chunk_size` rows the logits are computed, scaled by 1/T, the padded vocabulary ids (>= vocab_size)
set to PAD_LOGIT (the rollout engine's masking, `rollout.sampling.mask_padded_vocab`), and reduced into
log-prob and entropy exactly as `policy/logprobs.py` does (`chunk_stats`). Nothing vocab-sized is saved.

Backward recomputes each chunk's logits and its gradient G = dL/dlogits (`chunk_grad`, local to the shard) and
accumulates dL/dh = G W (summed over the TP ranks, as ColumnParallelLinear's input gradient is) and
dL/dW += G^T h (this shard's rows only). So at most one [chunk_size, V/tp] logits buffer and its gradient are
alive at a time: no [N, V] tensor or gradient ever exists. The weight gradient is returned to autograd, so a tied
embedding weight receives it like the unfused output layer's (megatron's DDP hooks and its embedding-group
all-reduce under PP see an ordinary gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from exgrpo_megatron.policy.logprobs import chunk_grad, chunk_stats, default_tp_group, grad_or_zeros, group_rank_size
from exgrpo_megatron.rollout.sampling import PAD_LOGIT


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float, valid_local: int,
                  compute_dtype: torch.dtype) -> Tensor:
    """z = (h W^T) / T for one chunk of rows in the compute dtype, padded vocabulary columns at PAD_LOGIT."""
    z = torch.matmul(hidden.to(weight.dtype), weight.t()).to(compute_dtype)
    if temperature != 1.0:
        z.div_(temperature)
    if valid_local < z.shape[-1]:
        z[:, valid_local:] = PAD_LOGIT
    return z


class _FusedOutputLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, tp_group: Any, chunk_size: int,
                temperature: float, with_entropy: bool, entropy_grad: bool, vocab_size: int) -> tuple[Tensor, Tensor]:
        tp_rank, _ = group_rank_size(tp_group)
        vocab_local = weight.shape[0]
        vocab_start = tp_rank * vocab_local
        valid_local = max(0, min(vocab_local, vocab_size - vocab_start))
        compute_dtype = torch.promote_types(weight.dtype, torch.float32)
        n = hidden.shape[0]
        row_max = torch.empty(n, dtype=compute_dtype, device=hidden.device)
        log_sum_exp, target_logit, entropy = (torch.empty_like(row_max) for _ in range(3))
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            z = _chunk_logits(hidden[rows], weight, temperature, valid_local, compute_dtype)
            row_max[rows], log_sum_exp[rows], target_logit[rows], entropy[rows] = chunk_stats(
                z, targets[rows], vocab_start, tp_group, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, row_max, log_sum_exp, entropy)
        ctx.config = (tp_group, vocab_start, valid_local, chunk_size, temperature, with_entropy and entropy_grad)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        return target_logit - log_sum_exp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, row_max, log_sum_exp, entropy = ctx.saved_tensors
        tp_group, vocab_start, valid_local, chunk_size, temperature, entropy_differentiable = ctx.config
        g_logp = grad_or_zeros(grad_logprobs, row_max)
        g_ent = grad_entropy.to(row_max.dtype) if entropy_differentiable and grad_entropy is not None else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty(hidden.shape, dtype=row_max.dtype, device=hidden.device) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=row_max.dtype, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, min(start + chunk_size, hidden.shape[0]))
            z = _chunk_logits(hidden[rows], weight, temperature, valid_local, row_max.dtype)
            g = chunk_grad(z, targets[rows], vocab_start, row_max[rows], log_sum_exp[rows], g_logp[rows],
                           entropy[rows], None if g_ent is None else g_ent[rows], temperature).to(weight.dtype)
            if grad_hidden is not None:  # need_h
                grad_hidden[rows] = torch.matmul(g, weight)
            if grad_weight is not None and grad_weight.dtype == weight.dtype:  # need_w
                grad_weight.addmm_(g.t(), hidden[rows].to(weight.dtype))  # in place: no second [V/tp, H] buffer
            elif grad_weight is not None:
                grad_weight.add_(torch.matmul(g.t(), hidden[rows].to(weight.dtype)))
            del g, z
        if need_h and group_rank_size(tp_group)[1] > 1:
            dist.all_reduce(grad_hidden, group=tp_group)  # every shard's vocabulary contributes to dL/dh
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, None, None, None)


def fused_output_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int = 256,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `targets` and entropy of softmax(h W^T / T) over the full (unpadded) vocabulary.

    hidden: [N, H] final hidden states (same on every TP rank). weight: [V/tp, H] this rank's output-weight shard
    (rank r holds ids [r V/tp, (r+1) V/tp)). targets: [N] int64 global ids < vocab_size. vocab_size: the true
    vocabulary size; ids >= vocab_size (megatron's padding) get no probability.
    tp_group, temperature, with_entropy, entropy_grad: as `vocab_parallel_logprobs_entropy`.
    chunk_size: rows of [chunk_size, V/tp] compute-dtype buffers alive at once.
    Returns (logprobs [N], entropy [N] or None) in float32 (float64 for float64 weights); gradients flow to
    `hidden` and `weight` in their dtypes.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V/tp, H] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must be [N] = {tuple(hidden.shape[:1])}")
    group = tp_group if tp_group is not None else default_tp_group()
    logprobs, entropy = _FusedOutputLogProbEntropy.apply(  # type: ignore[no-untyped-call]
        hidden, weight, targets.long(), group, int(chunk_size), float(temperature), bool(with_entropy),
        bool(entropy_grad), int(vocab_size))
    return logprobs, (entropy if with_entropy else None)
