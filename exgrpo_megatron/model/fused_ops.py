"""RMSNorm and RoPE of the local (CPU) layer spec, each one autograd function with a hand-written backward.

On CPU at the demo's and the throughput bench's shapes these element-wise layers are dispatch-bound: torch's
RMSNorm is a composite of six kernels forward and about a dozen backward, and megatron's RoPE recomputes cos/sin
in every call, builds rotate_half with a chunk + neg + cat and, for packed (THD) rows, loops over the sequences
in Python. Here each is a few whole-tensor kernels, same values up to fp32 rounding:

    RMSNorm   y = x * r * w,  r = rsqrt(mean(x^2) + eps)                                     (per token)
              dx = r * (g_n - n * mean(g_n * n)),  g_n = g_y * w,  n = x * r;   dw = sum_tokens(g_y * n)
    RoPE      y = x * C + roll(x, d/2) * S,  C = cos(f), S = [-1]*(d/2) + [1]*(d/2) signed sin(f)
              (roll(x, d/2) = [x2, x1], so roll(x) * S = [-x2 sin, x1 sin] = rotate_half(x) * sin: megatron's
              non-interleaved formula, f = the model's RotaryEmbedding frequencies at each token's position)
              dx = g * C + roll(g * S, -d/2)

A packed row's positions restart at every `cu_seqlens` entry, as megatron's THD RoPE does per sequence.
Selected by `model.fused_norm_rope` (conf/model/tiny_qwen2.yaml); the TE spec has its own fused kernels.
RMSNorm computes in fp32 for bf16 inputs (cast back at the end), as torch's RMSNorm does.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from torch import Tensor


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.to(_stats_dtype(x))
        r = xf.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, r)
        return (xf * r).mul_(weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, r = ctx.saved_tensors
        g = grad.to(r.dtype)
        n = x.to(r.dtype) * r
        grad_weight = (g * n).sum(dim=tuple(range(g.dim() - 1)))
        g_n = g * weight
        grad_x = torch.addcmul(g_n, n, (g_n * n).mean(-1, keepdim=True), value=-1).mul_(r)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def _stats_dtype(x: Tensor) -> torch.dtype:
    """fp32 for bf16/fp16 inputs, else the input's own dtype (fp32, or fp64 in the reference tests)."""
    return torch.promote_types(x.dtype, torch.float32)


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (same parameter, same state dict) through `RMSNormFunction`; built by the layer spec
    with megatron's norm constructor arguments."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        if config.normalization != "RMSNorm" or config.sequence_parallel or config.layernorm_zero_centered_gamma:
            raise ValueError("model.fused_norm_rope: plain RMSNorm without sequence parallelism only")
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), signed_sin)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, signed_sin = ctx.saved_tensors
        return torch.addcmul(torch.roll(grad * signed_sin, -(grad.shape[-1] // 2), -1), grad, cos), None, None


def rotary_tables(freqs: Tensor, cu_seqlens: Tensor | None, seq_len: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(C, S) [seq_len, 1, 1, d] for the tokens of a [seq_len, b, heads, d] query: position t (padded rows), or
    t minus its sequence's start (a packed row, `cu_seqlens` [sequences + 1])."""
    if cu_seqlens is None:
        f = freqs[:seq_len]
    else:
        bounds = cu_seqlens.to(freqs.device, torch.long)
        starts = torch.repeat_interleave(bounds[:-1], bounds[1:] - bounds[:-1], output_size=seq_len)
        f = freqs[torch.arange(seq_len, device=freqs.device) - starts]
    half = f.shape[-1] // 2
    sign = torch.ones(f.shape[-1], dtype=f.dtype, device=f.device)
    sign[:half] = -1
    return torch.cos(f).to(dtype), (torch.sin(f) * sign).to(dtype)


class FusedRopeSelfAttention(SelfAttention):
    """megatron's SelfAttention with RoPE applied by `RotaryFunction` to the projected query and key. Calls with
    an inference context (the rollout engine's fallback path) and rotary variants this does not implement
    (interleaved, partial, YaRN, per-layer no-RoPE, context parallelism) keep megatron's own RoPE."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._fusable = not (config.rotary_interleaved or config.no_rope_freq or config.context_parallel_size > 1
                             or hasattr(config, "yarn_rotary_scaling_factor") or config.fused_single_qkv_rope)
        self._rope: tuple[Tensor, Tensor | None] | None = None  # (freqs, cu_seqlens) during one forward

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        freqs = kwargs.get("rotary_pos_emb")
        params: PackedSeqParams | None = kwargs.get("packed_seq_params")
        if (args or not self._fusable or not isinstance(freqs, Tensor)
                or freqs.shape[-1] != self.hidden_size_per_attention_head
                or kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None
                or (params is not None and params.qkv_format != "thd")):
            return super().forward(hidden_states, *args, **kwargs)
        cu_seqlens = None if params is None else (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded
                                                  is not None else params.cu_seqlens_q)
        self._rope = (freqs, cu_seqlens)
        try:
            return super().forward(hidden_states, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        qkv = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope is None:
            return qkv
        query, key, *rest = qkv  # [s, b, heads, d]
        cos, signed_sin = rotary_tables(*self._rope, seq_len=query.shape[0], dtype=query.dtype)
        return (RotaryFunction.apply(query, cos, signed_sin), RotaryFunction.apply(key, cos, signed_sin), *rest)
