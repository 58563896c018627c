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
  attention, each sequence [cu_seqlens[i], cu_seqlens[i+1]) attending causally to itself only. No [t, t] mask
  exists: the sequences are grouped by length (`length_groups`), each group's tokens are copied into a
  right-padded [n, heads, longest, d] batch and run through ONE causal sdpa call (a real query at position p sees
  keys 0..p, all real; the padded queries' outputs are dropped, so they get no gradient), and the real rows are
  copied back. A group's padded slots are at most PACKED_PADDING_LIMIT x its real tokens. RoPE positions were
  already reset per sequence by the attention layer, from the same cu_seqlens (`model/fused_ops.rotary_tables`, or
  megatron's `_apply_rotary_pos_emb_thd` with `model.fused_norm_rope=false`).

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
PACKED_PADDING_LIMIT = 1.5  # a packed-attention group's padded slots / real tokens, at most (one sequence: 1)


def length_groups(lengths: list[int], limit: float = PACKED_PADDING_LIMIT) -> list[list[int]]:
    """Indices of `lengths` in groups of one padded attention call each: longest first, a sequence joins the
    current group while (members + 1) x the group's longest <= limit x (the group's real tokens + its own)."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= limit * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


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
        if bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens {bounds[0]}..{bounds[-1]} do not cover the {query.shape[0]} packed tokens")
        starts = torch.tensor(bounds[:-1])
        lengths = torch.tensor(bounds[1:]) - starts
        gqa = query.shape[1] != key.shape[1]
        groups = length_groups(lengths.tolist())
        # Our planner packs each micro-batch longest first, so every group is a run of adjacent sequences and the
        # groups come in packed order: split in, concatenate out. Other layouts gather and scatter by index.
        in_order = [i for g in groups for i in g] == list(range(len(lengths)))
        sizes = [int(lengths[g].sum()) for g in groups]
        parts = [x.split(sizes) for x in (query, key, value)] if in_order else None
        token_ids, outputs = [], []
        for j, group in enumerate(groups):
            members = torch.tensor(group)
            n, longest = len(group), int(lengths[members[0]])
            seq_of = torch.repeat_interleave(torch.arange(n), lengths[members])  # group-local sequence per token
            offset = torch.arange(len(seq_of)) - (torch.cumsum(lengths[members], 0) - lengths[members])[seq_of]
            if parts is not None:
                q, k, v = (part[j] for part in parts)  # the group's real tokens [t_g, heads, d]
            else:
                tokens = (starts[members][seq_of] + offset).to(query.device)  # their packed rows
                q, k, v = (x[tokens] for x in (query, key, value))
                token_ids.append(tokens)
            if n == 1:  # one sequence: no padding at all
                out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                     dropout_p=dropout, is_causal=longest > 1,
                                                     scale=self.softmax_scale, enable_gqa=gqa)  # [heads, L, d]
                outputs.append(out.transpose(0, 1).reshape(longest, self.hidden_size_per_partition))
                continue
            slots = (seq_of * longest + offset).to(query.device)  # row of each real token in [n * longest]
            qp, kp, vp = (_right_padded(x, slots, n, longest) for x in (q, k, v))
            out = F.scaled_dot_product_attention(qp, kp, vp, dropout_p=dropout, is_causal=True,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
            outputs.append(out.transpose(1, 2).reshape(n * longest, self.hidden_size_per_partition)[slots])
        context = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        if parts is not None:
            return context
        return context.new_zeros(context.shape).index_copy(0, torch.cat(token_ids), context)


def _right_padded(rows: Tensor, slots: Tensor, n: int, longest: int) -> Tensor:
    """The group's real rows [t_g, heads, d] placed at `slots` of a zero [n * longest] buffer, as the batch
    [n, heads, longest, d] (each sequence from position 0, zeros after it)."""
    buf = rows.new_zeros(n * longest, *rows.shape[1:]).index_copy(0, slots, rows)
    return buf.view(n, longest, *rows.shape[1:]).transpose(1, 2)
