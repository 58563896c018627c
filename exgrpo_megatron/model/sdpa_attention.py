"""Core attention for the local (CPU) layer spec through `torch.nn.functional.scaled_dot_product_attention`.

A drop-in for megatron's local `DotProductAttention` (same constructor, same [s, b, heads, d] inputs and
[s, b, heads*d] output) that computes softmax(scale * Q K^T + mask) V in one fused kernel instead of
baddbmm + masked softmax + bmm, and GQA without materialising repeated keys/values.

Masks, in megatron's convention (True = masked):
- `attention_mask=None` with a causal layer: plain causal attention (`is_causal`, the fastest kernel);
- a boolean mask [b or 1, 1, sq, sk]: masked scores get -10000 added (megatron's `attention_mask_func` fills
  them with -10000: the same softmax), and a query whose keys are all masked averages the values uniformly,
  as megatron's does (the rollout engine's masks never produce one: each query sees itself);
- packed sequences (`PackedSeqParams`, qkv_format "thd", query [t, heads, d]): block-diagonal causal
  attention, each sequence [cu_seqlens[i], cu_seqlens[i+1]) attending causally to itself only. The blocks are
  computed one by one, so no [t, t] mask exists. RoPE positions were already reset per sequence by megatron's
  attention layer (`_apply_rotary_pos_emb_thd` with the same cu_seqlens).

Selected by `model.core_attention` (conf/model/*.yaml); Transformer Engine stays the GPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

MASKED_SCORE = -10000.0  # megatron's attention_mask_func fill value


class SDPADotProductAttention(DotProductAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.softmax_type != "vanilla" or self.config.window_size is not None:
            raise ValueError("model.core_attention: sdpa supports vanilla softmax without sliding windows only")
        if self.config.apply_query_key_layer_scaling:
            raise ValueError("model.core_attention: sdpa does not implement query-key layer scaling")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the sdpa core attention")
        dropout = self.attention_dropout.p if self.training else 0.0
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, dropout)
        sq, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal, bias, dead = False, None, None
        if attention_mask is not None:
            bias = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device)
            bias.masked_fill_(attention_mask, MASKED_SCORE)
            dead = attention_mask.all(dim=-1, keepdim=True)  # queries with every key masked
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq != key.shape[0]:
                raise ValueError("causal attention without a mask needs as many queries as keys")
            causal = True
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, is_causal=causal,
                                             scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        if dead is not None and bool(dead.any()):
            # megatron *replaces* masked scores by -10000, so such a query weights all keys equally
            mean_v = v.mean(dim=-2, keepdim=True).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            out = torch.where(dead, mean_v, out)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, dropout: float) -> Tensor:
        if params.qkv_format != "thd":
            raise ValueError(f"packed sequences need qkv_format 'thd', got {params.qkv_format!r}")
        if query.dim() == 4:  # [t, 1, heads, d] -> [t, heads, d]
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        bounds = params.cu_seqlens_q.tolist()
        if bounds != params.cu_seqlens_kv.tolist():
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        gqa = query.shape[1] != key.shape[1]
        blocks = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [heads, L, d]
            blocks.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=end - start > 1,
                                                         scale=self.softmax_scale, enable_gqa=gqa).transpose(0, 1))
        if bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens {bounds[0]}..{bounds[-1]} do not cover the {query.shape[0]} packed tokens")
        return torch.cat(blocks).reshape(query.shape[0], self.hidden_size_per_partition)
