"""Pure name/layout mapping between megatron-core GPTModel parameters and HF tensors, for every family.

"Full" megatron tensors are in the TP=1 layout (what a TP all-gather produces) and carry global names;
megatron names and TP sharding are model/param_layout.py's. `LAYER_TENSORS` is the one table of a decoder
layer's tensors: megatron name, HF names, how the HF tensors join, full shape, and the family feature that
makes it exist (config/families.py). Rules from the HF model classes (transformers), checked by tests/test_convert.py:
  * linear_qkv rows are interleaved PER QUERY GROUP: for each group g, [q heads of g (H/G of them); k_g; v_g];
    the q/k/v biases (Qwen2) the same way (1-D). Under TP each rank holds G/TP whole groups, so a TP
    split of the full interleaved tensor is a plain dim-0 chunk (naive cat([q, k, v]) is the known bug).
  * linear_fc1 = cat([gate_proj, up_proj]) (TP shards it with stride 2: rank t holds [gate_t; up_t]).
  * QK-norm (Qwen3): q_norm / k_norm are megatron's q_layernorm / k_layernorm, one head's dim each.
  * Mixture of experts (Qwen3-MoE): mlp.gate is the router; expert e's gate/up/down projections are the
    `local_experts.{e}` MLP's linear_fc1 / linear_fc2 (e global; EP ranks hold slices, model/param_layout.py).
  * The vocabulary is zero-padded as `config.derived.padded_vocab_size` pads it on import and trimmed
    on export.
Names: local spec (`decoder.layers.{i}.input_layernorm.weight`) and TE spec
(`decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight`) are both accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from exgrpo_megatron.config.derived import head_dim, padded_vocab_size
from exgrpo_megatron.config.families import ModelFamily, family_of
from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.convert.hf_config import UnsupportedArchitectureError
from exgrpo_megatron.model.moe import expert_ffn_hidden_size
from exgrpo_megatron.model.param_layout import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    canonical_name,
    pad_vocab,
    split_expert_name,
    split_layer_name,
)

# HF tensors that carry no weights we need (old checkpoints store RoPE buffers).
IGNORABLE_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def _always(family: ModelFamily) -> bool:
    return True


def _dense(family: ModelFamily) -> bool:
    return family.moe is None


def _moe(family: ModelFamily) -> bool:
    return family.moe is not None


_EXPERT = "mlp.experts.local_experts.*"


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of decoder layer i: `decoder.layers.{i}.<megatron>` <-> `model.layers.{i}.<hf...>`."""

    megatron: str
    hf: tuple[str, ...]
    join: str  # "one": the same tensor | "qkv": group-interleaved q, k, v | "fc1": cat([gate, up])
    shape: Callable[[ModelConfig], tuple[int, ...]]  # the full (TP=1) megatron shape
    present: Callable[[ModelFamily], bool] = _always


def _qkv_rows(c: ModelConfig) -> int:
    return (c.num_attention_heads + 2 * c.num_query_groups) * head_dim(c)


LAYER_TENSORS: tuple[LayerTensor, ...] = (
    LayerTensor("input_layernorm.weight", ("input_layernorm.weight",), "one", lambda c: (c.hidden_size,)),
    LayerTensor("self_attention.linear_qkv.weight", tuple(f"self_attn.{n}_proj.weight" for n in "qkv"), "qkv",
                lambda c: (_qkv_rows(c), c.hidden_size)),
    LayerTensor("self_attention.linear_qkv.bias", tuple(f"self_attn.{n}_proj.bias" for n in "qkv"), "qkv",
                lambda c: (_qkv_rows(c),), present=lambda f: f.qkv_bias),
    LayerTensor("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "one", lambda c: (head_dim(c),),
                present=lambda f: f.qk_norm),
    LayerTensor("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "one", lambda c: (head_dim(c),),
                present=lambda f: f.qk_norm),
    LayerTensor("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "one",
                lambda c: (c.hidden_size, c.num_attention_heads * head_dim(c))),
    LayerTensor("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "one", lambda c: (c.hidden_size,)),
    LayerTensor("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1",
                lambda c: (2 * c.ffn_hidden_size, c.hidden_size), present=_dense),
    LayerTensor("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "one",
                lambda c: (c.hidden_size, c.ffn_hidden_size), present=_dense),
    # Mixture of experts (model/moe.py): the router, and expert * (a global expert index in both names).
    LayerTensor("mlp.router.weight", ("mlp.gate.weight",), "one", lambda c: (c.num_experts, c.hidden_size),
                present=_moe),
    LayerTensor(f"{_EXPERT}.linear_fc1.weight", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
                "fc1", lambda c: (2 * expert_ffn_hidden_size(c), c.hidden_size), present=_moe),
    LayerTensor(f"{_EXPERT}.linear_fc2.weight", ("mlp.experts.*.down_proj.weight",), "one",
                lambda c: (c.hidden_size, expert_ffn_hidden_size(c)), present=_moe),
)
_BY_SUFFIX = {t.megatron: t for t in LAYER_TENSORS}


def layer_tensors(cfg: ModelConfig) -> list[LayerTensor]:
    """The decoder-layer tensors of `cfg`'s family."""
    family = family_of(cfg.family)
    return [t for t in LAYER_TENSORS if t.present(family)]


def _layer_tensor(name: str, cfg: ModelConfig) -> tuple[int, LayerTensor, tuple[str, ...]]:
    """(layer, table row, the HF names under `model.layers.{layer}.`) of a canonical decoder-layer name that
    `cfg`'s family has; KeyError otherwise."""
    layer, suffix = split_layer_name(name)
    expert, generic = split_expert_name(suffix)
    row = _BY_SUFFIX.get(generic)
    if layer is None or row is None or not row.present(family_of(cfg.family)):
        raise KeyError(f"unknown megatron parameter {name!r} for model family {cfg.family!r}")
    if expert is not None and expert >= cfg.num_experts:
        raise KeyError(f"megatron parameter {name!r}: expert {expert} of {cfg.num_experts}")
    return layer, row, tuple(h.replace("*", str(expert)) for h in row.hf)


def megatron_param_names(cfg: ModelConfig) -> list[str]:
    """Every weight of the full (all stages) local-spec GPTModel, global layer indices."""
    rows = layer_tensors(cfg)
    names = [EMBEDDING]
    for i in range(cfg.num_layers):
        for t in rows:
            experts = range(cfg.num_experts) if "*" in t.megatron else [None]
            names += [f"decoder.layers.{i}.{t.megatron.replace('*', str(e))}" for e in experts]
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
    try:
        layer, row, hf_names = _layer_tensor(name, cfg)
    except KeyError:
        raise UnsupportedArchitectureError(f"megatron parameter {name!r} has no HF {cfg.family} equivalent") from None
    if row.join == "qkv":
        parts: tuple[torch.Tensor, ...] = split_qkv(full_tensor, *_qkv_dims(cfg))
    elif row.join == "fc1":
        parts = tuple(torch.chunk(full_tensor, 2, dim=0))
    else:
        parts = (full_tensor,)
    return [(f"model.layers.{layer}.{hf}", t) for hf, t in zip(hf_names, parts, strict=True)]


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
    layer, _, hf_names = _layer_tensor(name, cfg)
    return [f"model.layers.{layer}.{hf}" for hf in hf_names]


def hf_to_megatron(name: str, hf_tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_size: int = 1
                   ) -> torch.Tensor:
    """FULL megatron tensor `name` from the HF tensors listed by `hf_names_for(name, cfg)`; the vocabulary
    is zero-padded to `padded_vocab_size(vocab, make_vocab_size_divisible_by, tp_size)` rows (the builder's)."""
    name = canonical_name(name)
    srcs = [hf_tensors[n] for n in hf_names_for(name, cfg)]
    if name in (EMBEDDING, OUTPUT):
        return pad_vocab(srcs[0], cfg, tp_size)
    if name == FINAL_NORM:
        return srcs[0]
    row = _layer_tensor(name, cfg)[1]
    if row.join == "qkv":
        q, k, v = srcs
        return interleave_qkv(q, k, v, *_qkv_dims(cfg))
    if row.join == "fc1":
        return torch.cat(srcs, dim=0)
    return srcs[0]


def megatron_shape(name: str, cfg: ModelConfig, tp_size: int = 1) -> tuple[int, ...]:
    """Shape of the FULL megatron parameter `name` (vocabulary padded for `tp_size`)."""
    name = canonical_name(name)
    if name in (EMBEDDING, OUTPUT):
        return (padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp_size), cfg.hidden_size)
    if name == FINAL_NORM:
        return (cfg.hidden_size,)
    return _layer_tensor(name, cfg)[1].shape(cfg)
