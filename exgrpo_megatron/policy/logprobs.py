"""Fused log-prob of the target tokens and entropy from tensor-parallel vocab-sharded logits.

Megatron's `vocab_parallel` layout: TP rank r holds logits for the vocabulary slice [r*V/tp, (r+1)*V/tp).
With z = logits / T (temperature T), the softmax over the full vocabulary is p = exp(z - lse(z)), and

    logp_t = z_target - lse(z)               H = -sum_j p_j log p_j = lse(z) - sum_j p_j z_j

Forward, per chunk of rows (never more than `chunk_size` rows of fp32 vocab-sized buffers at once, never the full
vocabulary on one rank): the row max is all-reduced with MAX over the TP group; sum_j exp(z_j - m), the
target logit (taken only on the shard that owns the target, zero elsewhere) and sum_j exp(z_j - m)(z_j - m) are
all-reduced with SUM in one collective. Nothing vocab-sized is saved for backward: only the input logits
(already alive) and per-row max, log-sum-exp and entropy; the softmax is recomputed chunk by chunk.

Backward is local to each shard, needs no communication and is exact on every shard, because forward already
reduced every cross-shard quantity (a plain `dist.all_reduce` inside autograd would instead give wrong gradients
on the shards that do not own the target). With g_l = dL/dlogp and g_H = dL/dH, per vocabulary entry j:

    dlogp/dz_j = 1[j = target] - p_j          dH/dz_j = -p_j (log p_j + H)
    dL/dlogits_j = (g_l * 1[j = target] - p_j (g_l + g_H (log p_j + H))) / T

The g_H term is skipped when `entropy_grad=False` (entropy coefficient 0). The input logits are never modified
(megatron's own `vocab_parallel_cross_entropy` overwrites them). Pattern after slime's
`_VocabParallelLogProbEntropy` and NeMo-RL's `DistributedLogprob`; this code is our own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def default_tp_group() -> dist.ProcessGroup | None:
    """Megatron's tensor-parallel group when its parallel state is initialised, else None (TP size 1)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None  # megatron's parallel state needs a process group; skip importing megatron at all
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return None
    return ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _chunk_scaled_logits(logits_chunk: Tensor, temperature: float, compute_dtype: torch.dtype) -> Tensor:
    """A fresh compute-dtype copy of z = logits / T for one chunk (safe to modify in place)."""
    z = logits_chunk.to(compute_dtype, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    return z


GRAD_BLOCK_ROWS = 32  # rows whose p = exp(log p) is materialised at once in chunk_grad


def chunk_stats(z: Tensor, targets: Tensor, vocab_start: int, tp_group: dist.ProcessGroup | None,
                with_entropy: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward of one chunk of rows. z: a fresh compute-dtype buffer [R, V/tp] of logits / T (consumed);
    targets: [R] global ids. Returns per row (max m, lse(z) - m, z_target - m, entropy H), reduced over TP."""
    vocab_local = z.shape[-1]
    m = z.max(dim=-1).values
    if group_rank_size(tp_group)[1] > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    z.sub_(m.unsqueeze(-1))
    local_idx = targets - vocab_start
    owned = (local_idx >= 0) & (local_idx < vocab_local)
    z_t = z.gather(-1, local_idx.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
    z_t = torch.where(owned, z_t, torch.zeros_like(z_t))
    e = torch.exp(z)
    sum_exp = e.sum(dim=-1)
    sum_exp_z = e.mul_(z).sum(dim=-1) if with_entropy else torch.zeros_like(sum_exp)
    del z, e
    sums = torch.stack([sum_exp, z_t, sum_exp_z], dim=-1)
    if group_rank_size(tp_group)[1] > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    lse = torch.log(sums[:, 0])
    return m, lse, sums[:, 1], lse - sums[:, 2] / sums[:, 0]


def chunk_grad(z: Tensor, targets: Tensor, vocab_start: int, row_max: Tensor, log_sum_exp: Tensor,
               g_logp: Tensor, entropy: Tensor | None, g_entropy: Tensor | None, temperature: float) -> Tensor:
    """dL/dlogits of one chunk of rows, local to this shard (module docstring). z: a fresh compute-dtype
    buffer [R, V/tp] of logits / T (consumed and returned as the gradient); the other tensors are [R]."""
    vocab_local = z.shape[-1]
    grad_z = z.sub_((row_max + log_sum_exp).unsqueeze(-1))  # log p = z - row_max - lse_shifted
    g_l = g_logp.unsqueeze(-1)
    neg_inv_t = -1.0 / temperature  # dz/dlogits = 1/T, folded into the last multiply of each pass
    if g_entropy is not None:
        assert entropy is not None, "an entropy gradient needs the forward's entropy"
        # grad_z = -p * (g_l + g_H (log p + H)) / T, in the log_p buffer; p = exp(log p) exists for GRAD_BLOCK_ROWS
        # rows at a time, so the chunk needs one [R, V/tp] buffer, not two
        h, g_h = entropy.unsqueeze(-1), g_entropy.unsqueeze(-1)
        for r in range(0, grad_z.shape[0], GRAD_BLOCK_ROWS):
            rows = slice(r, r + GRAD_BLOCK_ROWS)
            log_p = grad_z[rows]
            p = torch.exp(log_p).mul_(neg_inv_t)
            log_p.add_(h[rows]).mul_(g_h[rows]).add_(g_l[rows]).mul_(p)
            del p
    else:
        grad_z.exp_().mul_(g_l * neg_inv_t)
    local_idx = targets - vocab_start
    owned = (local_idx >= 0) & (local_idx < vocab_local)
    onehot_grad = torch.where(owned, g_logp / temperature, torch.zeros_like(g_logp))
    grad_z.scatter_add_(-1, local_idx.clamp(0, vocab_local - 1).unsqueeze(-1), onehot_grad.unsqueeze(-1))
    return grad_z


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, tp_group: Any, chunk_size: int, temperature: float,
                with_entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor]:
        tp_rank, _ = group_rank_size(tp_group)
        vocab_local = logits.shape[-1]
        vocab_start = tp_rank * vocab_local
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        flat_logits = logits.reshape(-1, vocab_local)
        flat_targets = targets.reshape(-1)
        n = flat_logits.shape[0]

        row_max = torch.empty(n, dtype=compute_dtype, device=logits.device)
        log_sum_exp = torch.empty_like(row_max)  # lse(z) - row_max, i.e. relative to the shifted z
        target_logit = torch.empty_like(row_max)  # z_target - row_max
        entropy = torch.empty_like(row_max)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            z = _chunk_scaled_logits(flat_logits[rows], temperature, compute_dtype)
            row_max[rows], log_sum_exp[rows], target_logit[rows], entropy[rows] = chunk_stats(
                z, flat_targets[rows], vocab_start, tp_group, with_entropy)

        logprobs = (target_logit - log_sum_exp).reshape(targets.shape)
        entropy = entropy.reshape(targets.shape)
        ctx.save_for_backward(logits, targets, row_max, log_sum_exp, entropy)
        ctx.config = (vocab_start, chunk_size, temperature, with_entropy and entropy_grad)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, row_max, log_sum_exp, entropy = ctx.saved_tensors
        vocab_start, chunk_size, temperature, entropy_differentiable = ctx.config
        vocab_local = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab_local)
        flat_targets = targets.reshape(-1)
        g_logp = grad_or_zeros(grad_logprobs, row_max)
        g_ent = grad_entropy.reshape(-1).to(row_max.dtype) if entropy_differentiable and grad_entropy is not None \
            else None
        flat_entropy = entropy.reshape(-1)

        grad_logits = torch.empty_like(flat_logits)
        for start in range(0, flat_logits.shape[0], chunk_size):
            rows = slice(start, min(start + chunk_size, flat_logits.shape[0]))
            z = _chunk_scaled_logits(flat_logits[rows], temperature, row_max.dtype)
            grad_logits[rows] = chunk_grad(z, flat_targets[rows], vocab_start, row_max[rows], log_sum_exp[rows],
                                           g_logp[rows], flat_entropy[rows],
                                           None if g_ent is None else g_ent[rows], temperature)
        return grad_logits.reshape(logits.shape), None, None, None, None, None, None


def grad_or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    if grad is None:
        return torch.zeros_like(like)
    return grad.reshape(-1).to(like.dtype)


def vocab_parallel_logprobs_entropy(
    logits: Tensor,
    targets: Tensor,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `targets` and the entropy of softmax(logits / temperature) over the full vocabulary.

    logits: [..., V/tp], this rank's vocabulary shard (any float dtype; computed in float32, or float64 for
      float64 input). targets: [...] int64 global token ids. Targets outside [0, V) give finite values to be
      masked out by the caller.
    tp_group: the TP group holding the other vocabulary shards; None takes megatron's TP group when its
      parallel state is initialised, else treats the logits as the full vocabulary.
    chunk_size: rows of [chunk_size, V/tp] compute-dtype buffers alive at once (forward and backward).
    temperature: the sampling temperature T of the rollout; log-probs are those of softmax(logits / T).
    with_entropy: False skips the entropy (returns None for it).
    entropy_grad: False returns the entropy as a non-differentiable tensor and skips its backward
      (use it when the entropy coefficient is 0 and the entropy is only a metric).
    Returns (logprobs, entropy), each [...] in the compute dtype. The gradient wrt `logits` has its dtype.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits shape without vocab "
                         f"{tuple(logits.shape[:-1])}")
    group = tp_group if tp_group is not None else default_tp_group()
    logprobs, entropy = _VocabParallelLogProbEntropy.apply(  # type: ignore[no-untyped-call]
        logits, targets.long(), group, int(chunk_size), float(temperature), bool(with_entropy), bool(entropy_grad)
    )
    return logprobs, (entropy if with_entropy else None)
