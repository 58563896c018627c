"""Megatron parameter names and their TP/PP/VPP sharding, in one place.

Used by layout-invariant initialisation (model/layout_init.py), the vLLM refit (rollout/refit.py)
and both checkpoint converters (convert/hf_mapping.py, convert/dist_ckpt_io.py).

Names. The "global" name of a parameter is its name in the TP=1/PP=1 GPTModel: wrapper prefixes
(`module.` of DDP/Float16Module) stripped and the decoder layer index made global. Local-spec norm
names (`decoder.layers.{i}.input_layernorm.weight`) are canonical; the TE spec's fused names
(`...self_attention.linear_qkv.layer_norm_weight`, also the dist-checkpoint keys) map onto them.

Layers. Model chunk `vp_stage` on pipeline rank `pp_rank` holds the consecutive layers starting at
`layer_offset(...)`, megatron-core's even rule (transformer_layer.get_transformer_layer_offset):
without VPP `pp_rank * L / PP`; with VPP `vp_stage * L / VPP + pp_rank * L / (PP * VPP)`.

TP. A sharded parameter is cut along `dim` into TP x `stride` equal pieces and rank r holds pieces
r, r + TP, ... (megatron tensor_parallel/layers.py). Column-parallel (linear_qkv, embedding,
output_layer): dim 0, stride 1 - linear_qkv rows are interleaved per query group, so a dim-0 chunk
gives each rank whole groups; SwiGLU linear_fc1 = [gate; up]: dim 0, stride 2 (rank r holds
[gate_r; up_r]); row-parallel (linear_proj, linear_fc2): dim 1; norms (the QK-norms of one head's dim
too) are replicated. The
vocabulary (embedding, output_layer) is padded as `config.derived.padded_vocab_size` pads it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exgrpo_megatron.config.derived import padded_vocab_size
from exgrpo_megatron.config.schema import ModelConfig

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# MoE layers: expert j's SwiGLU MLP. Canonical (SequentialMLP, local spec):
# `mlp.experts.local_experts.{j}.linear_fc1.weight`; TE's grouped GEMM names the same matrix
# `mlp.experts.linear_fc1.weight{j}`. In a global name j is the global expert.
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
# TE fused-norm names -> local-spec names (the TE names are also the dist-checkpoint keys).
TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
LOCAL_TO_TE = {v: k for k, v in TE_TO_LOCAL.items()}


# ---------------------------------------------------------------- names
def canonical_name(name: str) -> str:
    """Strip wrapper prefixes (DDP/Float16Module `module.`) and map TE norm names to local names."""
    while name.startswith("module."):
        name = name[len("module."):]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in TE_TO_LOCAL:
        return f"decoder.layers.{m.group(1)}.{TE_TO_LOCAL[m.group(2)]}"
    g = _GROUPED_EXPERT_RE.match(m.group(2)) if m else None
    if m and g:
        return f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{g.group(2)}.{g.group(1)}.weight"
    return name


def split_expert_name(suffix: str) -> tuple[int | None, str]:
    """(expert index or None, the expert-independent suffix `mlp.experts.local_experts.*.<rest>`) of a layer suffix."""
    m = _EXPERT_RE.match(suffix)
    return (int(m.group(1)), f"mlp.experts.local_experts.*.{m.group(2)}") if m else (None, suffix)


def is_expert_param(name: str) -> bool:
    """A parameter of one expert (sharded over EP, and over ETP instead of TP)."""
    return split_expert_name(split_layer_name(canonical_name(name))[1])[0] is not None


def tp_coords(name: str) -> tuple[int, int]:
    """(size, rank) of the group that TP-shards parameter `name`: expert TP for experts, else TP."""
    from megatron.core import parallel_state as ps

    if is_expert_param(name):
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def local_expert_offset(num_experts: int) -> int:
    """Global index of this rank's first local expert: EP rank r holds experts r * E / EP, ... (megatron-core)."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() * (num_experts // ps.get_expert_model_parallel_world_size())


def split_layer_name(name: str) -> tuple[int | None, str]:
    """(layer index or None, suffix) of a canonical megatron name."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def layer_offset(num_layers: int, pp_size: int, pp_rank: int, vpp_size: int | None = None,
                 vp_stage: int | None = None) -> int:
    """Global index of the first layer of model chunk `vp_stage` on pipeline rank `pp_rank` (even split)."""
    chunks = pp_size * (vpp_size or 1)
    if num_layers % chunks:
        raise ValueError(f"num_layers={num_layers} is not divisible by PP={pp_size} x VPP={vpp_size or 1}")
    if vpp_size is None:
        return pp_rank * (num_layers // pp_size)
    if pp_size == 1:  # megatron-core would give every chunk offset 0, i.e. the same layers twice
        raise ValueError(f"VPP={vpp_size} needs pipeline parallelism (PP > 1)")
    if vp_stage is None or not 0 <= vp_stage < vpp_size:
        raise ValueError(f"vp_stage={vp_stage}: expected 0 <= vp_stage < VPP={vpp_size}")
    return vp_stage * (num_layers // vpp_size) + pp_rank * (num_layers // chunks)


def global_param_name(local_name: str, offset: int, expert_offset: int = 0) -> str:
    """Canonical global name of a chunk's parameter whose first layer is global layer `offset` (and whose first
    local expert is global expert `expert_offset`)."""
    name = canonical_name(local_name)
    layer, suffix = split_layer_name(name)
    if layer is None:
        return name
    expert, generic = split_expert_name(suffix)
    if expert is not None:
        suffix = generic.replace("*", str(expert + expert_offset))
    return f"decoder.layers.{layer + offset}.{suffix}"


def unwrap_chunk(chunk: torch.nn.Module) -> Any:
    """The bare GPTModel inside DDP / Float16Module wrappers (`.module`)."""
    gpt: Any = chunk
    while hasattr(gpt, "module"):
        gpt = gpt.module
    return gpt


def chunk_layer_offset(chunk: torch.nn.Module) -> int:
    """`layer_offset` of this rank's model chunk (parallel state initialised), checked against the
    `layer_number` megatron gave the chunk's layers."""
    from megatron.core import parallel_state as ps

    gpt = unwrap_chunk(chunk)
    config = gpt.config
    offset = layer_offset(config.num_layers, ps.get_pipeline_model_parallel_world_size(),
                          ps.get_pipeline_model_parallel_rank(), config.virtual_pipeline_model_parallel_size,
                          getattr(gpt, "vp_stage", None))
    numbers = [layer.layer_number for layer in gpt.decoder.layers]
    if numbers != list(range(offset + 1, offset + 1 + len(numbers))):
        raise ValueError(f"megatron placed layers {numbers} in this chunk; the even rule gives offset {offset} "
                         "(uneven pipeline layouts are not supported)")
    return offset


def named_global_params(chunks: Sequence[torch.nn.Module], *, tied_copy: bool
                        ) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters of all its model chunks under their global names, chunk by chunk in
    `named_parameters()` order. With tied embeddings at PP > 1 the last stage's `output_layer.weight` is a
    copy of the first stage's embedding: listed as EMBEDDING when `tied_copy`, otherwise left out."""
    named = []
    for chunk in chunks:
        gpt = unwrap_chunk(chunk)
        offset = chunk_layer_offset(gpt)
        experts = local_expert_offset(gpt.config.num_moe_experts) if gpt.config.num_moe_experts else 0
        tied = bool(getattr(gpt, "share_embeddings_and_output_weights", False))
        for local_name, param in gpt.named_parameters():
            name = global_param_name(local_name, offset, experts)
            if name == OUTPUT and tied:
                if not tied_copy:
                    continue
                name = EMBEDDING
            named.append((name, param))
    return named


# ---------------------------------------------------------------- TP sharding
@dataclass(frozen=True)
class TPSplit:
    """How a parameter is sharded over TP: cut along `dim` into TP x `stride` pieces, rank r holds
    pieces r, r + TP, ..."""

    dim: int
    stride: int = 1


COLUMN = TPSplit(0)
ROW = TPSplit(1)
SWIGLU = TPSplit(0, stride=2)
_LAYER_SPLITS: dict[str, TPSplit | None] = {
    "input_layernorm.weight": None,
    "pre_mlp_layernorm.weight": None,
    "self_attention.linear_qkv.weight": COLUMN,
    "self_attention.linear_qkv.bias": COLUMN,
    "self_attention.q_layernorm.weight": None,  # QK-norm: one head's dim, the same on every rank
    "self_attention.k_layernorm.weight": None,
    "self_attention.linear_proj.weight": ROW,
    "mlp.linear_fc1.weight": SWIGLU,
    "mlp.linear_fc2.weight": ROW,
    "mlp.router.weight": None,
    "mlp.experts.local_experts.*.linear_fc1.weight": SWIGLU,
    "mlp.experts.local_experts.*.linear_fc2.weight": ROW,
    # LoRA adapters (model/lora.py): a column-parallel linear's B is split as its rows, a row-parallel one's A as
    # its columns; the other factor is replicated
    "self_attention.linear_qkv.lora_a": None, "self_attention.linear_qkv.lora_b": COLUMN,
    "self_attention.linear_proj.lora_a": ROW, "self_attention.linear_proj.lora_b": None,
    "mlp.linear_fc1.lora_a": None, "mlp.linear_fc1.lora_b": SWIGLU,
    "mlp.linear_fc2.lora_a": ROW, "mlp.linear_fc2.lora_b": None,
    "mlp.experts.local_experts.*.linear_fc1.lora_a": None, "mlp.experts.local_experts.*.linear_fc1.lora_b": SWIGLU,
    "mlp.experts.local_experts.*.linear_fc2.lora_a": ROW, "mlp.experts.local_experts.*.linear_fc2.lora_b": None,
}
ADAPTER_SUFFIXES = ("lora_a", "lora_b")


def is_adapter(name: str) -> bool:
    """A LoRA adapter parameter (or checkpoint key) `...<linear>.lora_a` / `...<linear>.lora_b` (model/lora.py)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES
VOCAB_PARALLEL = (EMBEDDING, OUTPUT)


def tp_split_of_name(name: str) -> TPSplit | None:
    """The TP split of megatron parameter `name` (None: replicated), from its name."""
    name = canonical_name(name)
    if name in VOCAB_PARALLEL:
        return COLUMN
    if name == FINAL_NORM:
        return None
    layer, suffix = split_layer_name(name)
    suffix = split_expert_name(suffix)[1]
    if layer is None or suffix not in _LAYER_SPLITS:
        raise KeyError(f"unknown megatron parameter {name!r}")
    return _LAYER_SPLITS[suffix]


def tp_split_of_param(param: torch.Tensor) -> TPSplit | None:
    """The TP split megatron recorded on a parameter (`tensor_model_parallel`, `partition_dim`,
    `partition_stride`); None when it is replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return TPSplit(int(param.partition_dim), int(getattr(param, "partition_stride", 1)))  # type: ignore[attr-defined]


def tp_shard(full: torch.Tensor, split: TPSplit | None, tp_size: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s part of a full (TP=1 layout) tensor."""
    if split is None or tp_size == 1:
        return full
    pieces = full.chunk(tp_size * split.stride, dim=split.dim)
    if len(pieces) != tp_size * split.stride or full.shape[split.dim] % (tp_size * split.stride):
        raise ValueError(f"dim {split.dim} of {tuple(full.shape)} is not divisible by TP={tp_size} x stride "
                         f"{split.stride}")
    return torch.cat(pieces[tp_rank::tp_size], dim=split.dim)


def tp_unshard(shards: Sequence[torch.Tensor], split: TPSplit | None) -> torch.Tensor:
    """Inverse of `tp_shard`: the full tensor from every TP rank's shard (index = TP rank)."""
    if split is None or len(shards) == 1:
        return shards[0]
    pieces = [s.chunk(split.stride, dim=split.dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(split.stride) for r in range(len(shards))], dim=split.dim)


def tp_full_shape(shape: Sequence[int], split: TPSplit | None, tp_size: int) -> tuple[int, ...]:
    """Full (TP=1) shape of a shard of `shape`."""
    full = list(shape)
    if split is not None:
        full[split.dim] *= tp_size
    return tuple(full)


def pad_vocab(t: torch.Tensor, cfg: ModelConfig, tp_size: int) -> torch.Tensor:
    """The real vocabulary rows of `t` (the first `cfg.vocab_size`), zero-padded to the builder's padded size
    for `tp_size` (`padded_vocab_size`)."""
    rows = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp_size)
    t = t[: cfg.vocab_size]  # rows >= vocab_size: padding only appends
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)

