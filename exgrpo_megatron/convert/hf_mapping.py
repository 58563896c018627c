"""Pure name/layout mapping between megatron-core GPTModel parameters and HF Qwen2/Llama tensors.

"Full" megatron tensors are in the TP=1 layout (what a TP all-gather produces) and carry global names;
megatron names and TP sharding are model/param_layout.py's. Rules from the HF model configs
section 4 and anchors.md section C:
  * linear_qkv rows are interleaved PER QUERY GROUP: for each group g, [q heads of g (H/G of them); k_g; v_g];
    Qwen2's q/k/v biases the same way (1-D). Under TP each rank holds G/TP whole groups, so a TP
    split of the full interleaved tensor is a plain dim-0 chunk (naive cat([q, k, v]) is the known bug).
  * linear_fc1 = cat([gate_proj, up_proj]) (TP shards it with stride 2: rank t holds [gate_t; up_t]).
  * The vocabulary is zero-padded as `config.derived.padded_vocab_size` pads it on import and trimmed
    on export.
Names: local spec (`decoder.layers.{i}.input_layernorm.weight`) and TE spec
(`decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight`) are both accepted.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from exgrpo_megatron.config.derived import padded_vocab_size
from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.convert.hf_config import UnsupportedArchitectureError, head_dim
from exgrpo_megatron.model.param_layout import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    canonical_name,
    pad_vocab,
    split_layer_name,
)

# local-spec layer suffix -> HF suffix (under model.layers.{i}.) for the one-to-one tensors
_LAYER_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# HF tensors that carry no weights we need (old checkpoints store RoPE buffers).
IGNORABLE_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def megatron_param_names(cfg: ModelConfig) -> list[str]:
    """Every weight of the full (all stages) local-spec GPTModel, global layer indices."""
    names = [EMBEDDING]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if cfg.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight",
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append(FINAL_NORM)
    if not cfg.tie_word_embeddings:
        names.append(OUTPUT)
    return names


# ---------------------------------------------------------------- QKV interleave / SwiGLU fusion
def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
                   dim: int) -> torch.Tensor:
    """Megatron linear_qkv from HF q/k/v (weights [rows, hidden] or 1-D biases):
    rows = concat over groups g of [q[g*r:(g+1)*r], k[g], v[g]] with r = num_heads / num_groups heads of `dim` rows."""
    if num_heads % num_groups:
        raise UnsupportedArchitectureError(f"num_attention_heads {num_heads} not divisible by kv heads {num_groups}")
    r = num_heads // num_groups
    tail = q.shape[1:]
    qg = q.reshape(num_groups, r * dim, *tail)
    kg = k.reshape(num_groups, dim, *tail)
    vg = v.reshape(num_groups, dim, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(num_groups * (r + 2) * dim, *tail)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int, dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `interleave_qkv` (also valid for a TP shard when given that shard's heads/groups)."""
    r = num_heads // num_groups
    tail = qkv.shape[1:]
    blocks = qkv.reshape(num_groups, (r + 2) * dim, *tail)
    q, k, v = torch.split(blocks, [r * dim, dim, dim], dim=1)
    return (q.reshape(num_heads * dim, *tail), k.reshape(num_groups * dim, *tail), v.reshape(num_groups * dim, *tail))


def _qkv_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    return cfg.num_attention_heads, cfg.num_query_groups, head_dim(cfg)


# ---------------------------------------------------------------- megatron -> HF
def megatron_to_hf(name: str, full_tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one FULL (TP-gathered) megatron tensor with its global name
    (model/param_layout.py). `_extra_state` entries and a tied output layer map to nothing; vocabulary
    padding is trimmed."""
    name = canonical_name(name)
    if name.endswith("._extra_state"):
        return []
    if name == EMBEDDING:
        return [("model.embed_tokens.weight", full_tensor[: cfg.vocab_size])]
    if name == OUTPUT:
        return [] if cfg.tie_word_embeddings else [("lm_head.weight", full_tensor[: cfg.vocab_size])]
    if name == FINAL_NORM:
        return [("model.norm.weight", full_tensor)]
    layer, suffix = split_layer_name(name)
    if layer is None:
        raise KeyError(f"unknown megatron parameter {name!r}")
    p = f"model.layers.{layer}."
    if suffix in _LAYER_ONE_TO_ONE:
        return [(p + _LAYER_ONE_TO_ONE[suffix], full_tensor)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(full_tensor, *_qkv_dims(cfg))
        return [(f"{p}self_attn.{n}_proj.{kind}", t) for n, t in (("q", q), ("k", k), ("v", v))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(full_tensor, 2, dim=0)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    raise UnsupportedArchitectureError(f"megatron parameter {name!r} has no HF Qwen2/Llama equivalent")


# ---------------------------------------------------------------- HF -> megatron
def hf_names_for(name: str, cfg: ModelConfig) -> list[str]:
    """HF tensor names needed to build megatron parameter `name` (canonical, global layer index)."""
    name = canonical_name(name)
    if name == EMBEDDING:
        return ["model.embed_tokens.weight"]
    if name == OUTPUT:
        return ["lm_head.weight"]
    if name == FINAL_NORM:
        return ["model.norm.weight"]
    layer, suffix = split_layer_name(name)
    p = f"model.layers.{layer}."
    if suffix in _LAYER_ONE_TO_ONE:
        return [p + _LAYER_ONE_TO_ONE[suffix]]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return [f"{p}self_attn.{n}_proj.{kind}" for n in ("q", "k", "v")]
    if suffix == "mlp.linear_fc1.weight":
        return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    raise KeyError(f"unknown megatron parameter {name!r}")


def hf_to_megatron(name: str, hf_tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_size: int = 1
                   ) -> torch.Tensor:
    """FULL megatron tensor `name` from the HF tensors listed by `hf_names_for(name, cfg)`; the vocabulary
    is zero-padded to `padded_vocab_size(vocab, make_vocab_size_divisible_by, tp_size)` rows (the builder's)."""
    name = canonical_name(name)
    srcs = [hf_tensors[n] for n in hf_names_for(name, cfg)]
    if name in (EMBEDDING, OUTPUT):
        return pad_vocab(srcs[0], cfg, tp_size)
    _, suffix = split_layer_name(name)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        q, k, v = srcs
        return interleave_qkv(q, k, v, *_qkv_dims(cfg))
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat(srcs, dim=0)
    return srcs[0]


def megatron_shape(name: str, cfg: ModelConfig, tp_size: int = 1) -> tuple[int, ...]:
    """Shape of the FULL megatron parameter `name` (vocabulary padded for `tp_size`)."""
    name = canonical_name(name)
    h, heads, groups, dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, head_dim(cfg)
    if name in (EMBEDDING, OUTPUT):
        return (padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp_size), h)
    if name == FINAL_NORM:
        return (h,)
    _, suffix = split_layer_name(name)
    shapes = {
        "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": ((heads + 2 * groups) * dim, h),
        "self_attention.linear_qkv.bias": ((heads + 2 * groups) * dim,),
        "self_attention.linear_proj.weight": (h, heads * dim),
        "mlp.linear_fc1.weight": (2 * cfg.ffn_hidden_size, h),
        "mlp.linear_fc2.weight": (h, cfg.ffn_hidden_size),
    }
    if suffix not in shapes:
        raise KeyError(f"unknown megatron parameter {name!r}")
    return shapes[suffix]
