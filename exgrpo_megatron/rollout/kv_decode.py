"""One pipeline stage of a megatron-core GPTModel over a contiguous, RoPE-once KV cache (`KVCacheStage`), and the
reference stage through megatron's own inference path (`StaticContextStage`).

Why not megatron's own `StaticInferenceContext` path: it caches keys BEFORE RoPE, so every decode
step re-rotates the whole cached prefix of every layer (recomputing cos/sin of every position), and
the local `DotProductAttention` `repeat_interleave`s the cached keys and values to all query heads:
two O(prefix) copies per layer per generated token, which dominated the decode loop on CPU.

`KVCacheStage` runs the model's own megatron modules (embedding, input / pre-MLP / final norms,
`get_query_key_value_tensors` (linear_qkv, q/k norms), linear_proj, MLP, output layer; all TP-aware,
TP collectives inside them) and replaces only the attention core, per layer l and query position t:

    K_l[b, g, t] = RoPE(k_t, t),  V_l[b, g, t] = v_t                        (written once)
    o[b, h, t]   = softmax_s(scale * <RoPE(q_t, t)[b, h], K_l[b, g(h), s]> + mask[b, t, s]) V_l[b, g(h), s]

with g(h) = h // (heads / groups) (megatron's GQA grouping), scale = config.softmax_scale or
1/sqrt(head_dim), the softmax in fp32, and the query heads of a group attending to that group's
keys without copies (`cache_attention`: torch's fused kernel in bf16, explicit matmuls in fp32).
mask[b, t, s] is 0 or -inf. RoPE is megatron's formula (x cos + rotate_half(x) sin, cos/sin of the
model's own RotaryEmbedding freqs), so the stage computes the same function as `GPTModel.forward`
up to fp rounding.

`attention_mask` returns True where a key may be attended (torch SDPA's convention, the opposite of
megatron's). Query positions of left padding attend only to themselves, which keeps them finite.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.autograd.profiler


def unsupported_reason(model) -> str | None:
    """None when `KVCacheStage` computes `model`'s function; else why not (the engine then falls
    back to megatron's StaticInferenceContext path). Checks the model features the stage re-implements."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    cfg = model.config
    checks = {
        "position embedding is not RoPE": getattr(model, "position_embedding_type", None) != "rope",
        "multi-latent attention": cfg.multi_latent_attention,
        "sequence parallelism": cfg.sequence_parallel,
        "context parallelism": cfg.context_parallel_size > 1,
        "interleaved RoPE": cfg.rotary_interleaved,
        "per-layer no_rope": bool(cfg.no_rope_freq),
        "attention output gate": cfg.attention_output_gate,
        "query-key layer scaling": cfg.apply_query_key_layer_scaling,
        "non-vanilla softmax": getattr(cfg, "softmax_type", "vanilla") != "vanilla",
        "multi-token prediction": getattr(model, "mtp_process", False),
        "fused TP inference kernels": getattr(cfg, "inference_fuse_tp_communication", False),
        "fp8/fp4": bool(cfg.fp8) or bool(getattr(cfg, "fp4", None)),
        "fp32 residual connection": cfg.fp32_residual_connection,
    }
    layers = list(model.decoder.layers)
    checks["layer is not a TransformerLayer"] = any(type(layer) is not TransformerLayer for layer in layers)
    checks["cross attention"] = any(not isinstance(getattr(layer, "cross_attention", None), IdentityOp)
                                    for layer in layers)
    return next((why for why, bad in checks.items() if bad), None)


def profile_range(name: str) -> contextlib.AbstractContextManager:
    """A `torch.profiler` range called `name` while a profiler records (bench/decode_profile.py buckets the decode
    time by these ranges), else nothing: an unused range still costs microseconds per call."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[-sin, sin] halves of `sin` [..., d_rot]: rotate_half(x) * sin == roll(x, d_rot/2) * signed_sin(sin), exactly
    (rotate_half(x) = [-x2, x1] and roll(x) = [x2, x1]; (-a) * b == a * (-b) in floating point)."""
    sign = torch.ones(sin.shape[-1], dtype=sin.dtype, device=sin.device)
    sign[: sin.shape[-1] // 2] = -1
    return sin * sign


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, d] rotated by per-position cos / `signed_sin(sin)` [s, 1, 1, d_rot]; dims >= d_rot pass.
    Megatron's x cos + rotate_half(x) sin, bit for bit, in three kernels (mul, roll, mul) and an add instead of
    rotate_half's chunk + neg + cat."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + torch.roll(x, rot // 2, -1) * sin_signed
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + torch.roll(head, rot // 2, -1) * sin_signed, tail), dim=-1)


def attention_mask(valid: torch.Tensor, start: int, seq: int) -> torch.Tensor:
    """[b, 1, seq, start+seq], True = may attend: query at position start+i sees real keys
    (`valid` [b, >= start+seq]) at positions <= start+i, and always itself (keeps pad rows finite)."""
    end = start + seq
    queries = torch.arange(start, end, device=valid.device)[:, None]
    keys = torch.arange(end, device=valid.device)[None]
    return ((keys <= queries)[None] & valid[:, None, :end] | (keys == queries)[None])[:, None]


class KVCacheStage:
    """This rank's pipeline stage of `model` (eval, no_grad) with a [b, groups, max_len, d] cache
    per local layer, allocated by the first (prefill) forward for its batch.

    `forward(tokens, hidden, start, valid)`: token ids [b, s] on the first stage, else the previous
    stage's `hidden` [s, b, h]; writes positions start..start+s-1, attends under
    `attention_mask(valid, start, s)`, and returns the last position's logits [b, V] on the last
    stage (TP-gathered), the hidden states [s, b, h] elsewhere. `select_rows(index)` keeps / copies
    cache rows (prompt -> its n samples, finished rows dropped)."""

    def __init__(self, model, max_len: int) -> None:
        self.model = model
        cfg = model.config
        self.layers = list(model.decoder.layers)
        self.head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.scale = cfg.softmax_scale if cfg.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        freqs = model.rotary_pos_emb(max_len)  # [max_len, 1, 1, d_rot], the model's own freqs
        dtype = cfg.params_dtype
        self.cos, self.sin = torch.cos(freqs).to(dtype), signed_sin(torch.sin(freqs).to(dtype))
        self.max_len = max_len
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.filled = 0  # positions [0, filled) of every cache row are written

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep/copy cache rows by `index`; only the written positions [0, filled) are copied (a decode step drops
        finished rows, so copying the whole max_len cache each time would dominate short responses)."""
        def take(cache: torch.Tensor) -> torch.Tensor:
            out = cache.new_empty((len(index), *cache.shape[1:]))
            out[:, :, :self.filled] = cache[index, :, :self.filled]
            return out

        with profile_range("select_rows"):
            self.cache = [(take(k), take(v)) for k, v in self.cache]

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor | None, start: int, valid: torch.Tensor):
        model = self.model
        seq = tokens.shape[1]
        if model.pre_process:
            positions = torch.arange(start, start + seq, device=tokens.device)[None].expand_as(tokens)
            hidden = model.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        assert hidden is not None, "a stage without the embedding needs the previous stage's hidden states"
        mask = attention_mask(valid, start, seq)
        cos, sin = self.cos[start: start + seq], self.sin[start: start + seq]
        for i, layer in enumerate(self.layers):
            hidden = self._layer(i, layer, hidden, start, cos, sin, mask)
        self.filled = max(self.filled, start + seq)
        if not model.post_process:
            return hidden
        final_norm = model.decoder.final_layernorm
        if final_norm is not None:
            hidden = final_norm(hidden)
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden[-1:], weight=weight, runtime_gather_output=True)
        return logits[0]

    def _layer(self, i: int, layer, hidden, start: int, cos, sin, mask) -> torch.Tensor:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with profile_range("cache_write"):
                k_cache, v_cache = self._cache(i, k)
                end = start + k.shape[0]
                k_cache[:, :, start:end] = k.permute(1, 2, 0, 3)
                v_cache[:, :, start:end] = v.permute(1, 2, 0, 3)
            with profile_range("attention"):
                return self._attention(q, k_cache[:, :, :end], v_cache[:, :, :end], mask)

        return layer_forward(layer, hidden, cos, sin, attend)

    def _cache(self, i: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if i == len(self.cache):
            shape = (k.shape[1], k.shape[2], self.max_len, k.shape[3])
            self.cache.append((k.new_empty(shape), k.new_empty(shape)))
        return self.cache[i]

    def _attention(self, q, keys, values, mask) -> torch.Tensor:
        return cache_attention(q, keys, values, mask, self.scale)


class StaticContextStage:
    """This rank's stage through megatron-core's own inference path: `GPTModel.forward` over a
    `StaticInferenceContext` (keys cached before RoPE). Same interface as `KVCacheStage`."""

    def __init__(self, model, batch: int, max_len: int) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model = model
        self.ctx = StaticInferenceContext(max_batch_size=batch, max_sequence_length=max_len)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep/copy batch rows of every layer's static KV cache ([seq, batch, ...]) by `index`."""
        memory = self.ctx.key_value_memory_dict
        for layer, (k, v) in memory.items():
            memory[layer] = (k[:, index], v[:, index])

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor | None, start: int, valid: torch.Tensor):
        batch, seq = tokens.shape
        if hidden is not None:
            self.model.set_input_tensor(hidden)
        positions = torch.arange(start, start + seq, device=tokens.device)[None].expand(batch, seq)
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=~attention_mask(valid, start, seq),
                         inference_context=self.ctx, runtime_gather_output=True)  # megatron mask: True = masked
        self.ctx.sequence_len_offset = start + seq
        if start == 0:
            self.ctx.enable_decode_mode()
        return out[:, -1, :] if self.model.post_process else out


def layer_forward(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One TransformerLayer over hidden [s, b, h] with the layer's own modules: norms, q/k/v projections, RoPE by
    `cos` / `signed_sin` (broadcast against [s, b, heads, d]), `attend(q, k, v)` -> context [s, b, H*d] (the
    caller's cache write + attention), output projection, MLP, the two residual adds."""
    attn = layer.self_attention
    q, k, v = attn.get_query_key_value_tensors(layer.input_layernorm(hidden))  # [s, b, heads|groups, d]
    with profile_range("rope"):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    context = attend(q, k, v)
    out, bias = attn.linear_proj(context)
    hidden = hidden + (out if bias is None else out + bias)
    out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
    return hidden + (out if bias is None else out + bias)


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [s, b, H, d], keys/values [b, G, T, d], mask [b, 1, s, T] (True = may attend) -> context [s, b, H*d].

    fp32: explicit matmuls with the query heads of a group batched against its keys, the softmax in fp32.
    bf16/fp16: torch's fused `scaled_dot_product_attention` (GQA without copies, fp32 accumulation and softmax
    inside), 25-30% faster than the explicit path at the decode's shapes (32 rows, 9 heads / 3 groups, 100-300
    cached positions, CPU time) and closer to the exact value (no bf16 rounding of the scores and probabilities);
    in fp32 the fused kernel is slower, and the explicit path keeps the fp32 engine's samples as they were.
    On CUDA every dtype takes the explicit path: torch runs `enable_gqa` only in its flash and math kernels, and
    flash takes no mask, so the fused call falls back to the math kernel, which copies each group's keys and
    values to every query head of the group (6x the cache at Qwen2.5-1.5B's 12 / 2 heads) at every decode step."""
    if cache_attention_path(q.dtype, q.device.type) == "fused":
        return fused_cache_attention(q, keys, values, mask, scale)
    return explicit_cache_attention(q, keys, values, mask, scale)


def cache_attention_path(dtype: torch.dtype, device_type: str) -> str:
    """Which path `cache_attention` takes: "fused" for bf16/fp16 off CUDA, else "explicit"."""
    return "fused" if dtype in (torch.bfloat16, torch.float16) and device_type != "cuda" else "explicit"


def fused_cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """`cache_attention` through torch's `scaled_dot_product_attention` (GQA by enable_gqa: query head h reads
    group h // (H / G), megatron's grouping)."""
    s, b, heads, d = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(q.permute(1, 2, 0, 3), keys, values, attn_mask=mask,
                                                           scale=scale, enable_gqa=heads != keys.shape[1])
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def explicit_cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """`cache_attention` as matmul, fp32 masked softmax, matmul; a group's query heads batched against its keys."""
    s, b, heads, d = q.shape
    groups = keys.shape[1]
    per_group = heads // groups
    qg = q.permute(1, 2, 0, 3).reshape(b, groups, per_group * s, d)  # rows (head in group, position)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).view(b, groups, per_group, s, -1)
    scores = scores.float().mul_(scale).masked_fill_(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(b, groups, per_group * s, -1)
    context = torch.matmul(probs, values).view(b, heads, s, d)  # heads ordered (group, head in group)
    return context.permute(2, 0, 1, 3).reshape(s, b, heads * d)
