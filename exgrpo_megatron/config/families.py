"""The model families: one frozen description per architecture, the one place that says how they differ.

A family is what every checkpoint of one HuggingFace `model_type` shares: which projections carry a bias,
whether queries and keys are normalised per head (QK-norm), which RoPE scaling megatron-core implements for it,
the norm and the activation, how its `config.json` spells things, the HF keys that switch on its sliding-window
attention (our models have none: the converter refuses them) and (for mixture-of-experts families) the HF keys of
its routing. The numbers that vary from checkpoint to checkpoint (sizes, `rope_theta`, the norm's eps, tied
embeddings, head dim) are `ModelConfig`'s; the family gives the value HF's config class assumes when a
`config.json` leaves one out.

Read by: the model builder (model/builder.py: TransformerConfig and both layer specs), both converters
(convert/hf_config.py: config.json <-> ModelConfig; convert/hf_mapping.py: which tensors exist and their HF
names, which the vLLM refit streams), the dry run's parameter count (planning/dry_run.py) and start-up validation.

Adding a dense family that megatron-core can express (RMSNorm, SwiGLU, RoPE, GQA) is one entry in `FAMILIES`
plus its conversion test against transformers' own model class (docs/models.md).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEKeys:
    """The HF `config.json` keys that carry a mixture-of-experts family's routing (the values are per model).
    None: the family has no such setting."""

    num_experts: str  # routed experts per MoE layer
    top_k: str  # experts per token
    moe_intermediate_size: str  # one expert's FFN size
    norm_topk_prob: str | None  # renormalise the top-k routing weights to sum to 1
    shared_experts: str | None  # the shared expert's FFN size
    decoder_sparse_step: str | None  # every n-th layer is an MoE layer
    mlp_only_layers: str | None  # layers that keep a dense MLP


@dataclass(frozen=True)
class SlidingWindowKeys:
    """The HF `config.json` keys with which a family's attention looks only at the last `size` tokens, as its HF model
    class reads them. Our models attend to every earlier token, so the converter refuses a config that enables a
    window (convert/hf_config.py `windowed_layers`) and the export writes the keys switched off."""

    size: str  # the window's length in tokens; a window applies only where it is set (not null)
    size_default: int | None  # the window's length when config.json leaves `size` out
    enable: str | None = None  # the switch (Qwen's use_sliding_window); None: the window applies whenever it is set
    enable_default: bool = False  # the switch's value when config.json leaves it out
    first_windowed_layer: str | None = None  # layers from this index on are windowed (Qwen2's max_window_layers)
    first_windowed_layer_default: int = 0  # ... when config.json leaves it out; None key: every layer windowed
    layer_types: str | None = None  # an explicit per-layer list ("sliding_attention" | "full_attention"), read first


@dataclass(frozen=True)
class ModelFamily:
    """One architecture; `name` is both `model.family` and the HF `model_type`."""

    name: str
    hf_architecture: str  # config.json "architectures"
    qkv_bias: bool  # bias on the q/k/v projections (megatron linear_qkv) and on no other linear layer
    qk_norm: bool  # RMSNorm over each head's query and key before RoPE (megatron qk_layernorm)
    rope_scaling: tuple[str, ...] = ()  # HF rope types megatron-core implements for it, besides "default"
    rope_theta_default: float = 10000.0  # config.json without rope_theta
    head_dim_default: int | None = None  # config.json without head_dim; None: hidden_size / num_attention_heads
    rms_norm_eps_default: float = 1e-6  # config.json without rms_norm_eps
    tie_word_embeddings_default: bool = False  # config.json without tie_word_embeddings
    normalization: str = "RMSNorm"  # every norm (megatron TransformerConfig.normalization)
    activation: str = "silu"  # gated: SwiGLU, fc1 = [gate; up] (HF hidden_act)
    hf_writes_head_dim: bool = True  # export always writes head_dim (False: only when != hidden / heads)
    hf_fixed_keys: tuple[tuple[str, Any], ...] = ()  # config.json keys the export writes as they are
    sliding_window: SlidingWindowKeys | None = None  # None: the family has no sliding-window attention
    moe: MoEKeys | None = None  # None: dense


# transformers' Qwen2Config / Qwen3Config: a window of sliding_window tokens on the layers from max_window_layers on,
# when use_sliding_window (or as layer_types lists them).
QWEN_WINDOW = SlidingWindowKeys(size="sliding_window", size_default=4096, enable="use_sliding_window",
                                first_windowed_layer="max_window_layers", first_windowed_layer_default=28,
                                layer_types="layer_types")
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    ModelFamily(name="qwen2", hf_architecture="Qwen2ForCausalLM", qkv_bias=True, qk_norm=False,
                hf_writes_head_dim=False, sliding_window=QWEN_WINDOW),
    ModelFamily(name="llama", hf_architecture="LlamaForCausalLM", qkv_bias=False, qk_norm=False,
                rope_scaling=("llama3",), hf_fixed_keys=(("attention_bias", False), ("mlp_bias", False))),
    ModelFamily(name="qwen3", hf_architecture="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, head_dim_default=128,
                hf_fixed_keys=(("attention_bias", False),), sliding_window=QWEN_WINDOW),
    # Qwen3-MoE: Qwen3's attention; every layer's MLP a mixture of routed SwiGLU experts, no shared expert
    # (model/moe.py); transformers' Qwen3MoeConfig defaults norm_topk_prob to False and, with use_sliding_window,
    # windows every layer (it has no max_window_layers or layer_types).
    ModelFamily(name="qwen3_moe", hf_architecture="Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True,
                head_dim_default=128, hf_fixed_keys=(("attention_bias", False),),
                sliding_window=SlidingWindowKeys(size="sliding_window", size_default=4096, enable="use_sliding_window"),
                moe=MoEKeys(num_experts="num_experts", top_k="num_experts_per_tok",
                            moe_intermediate_size="moe_intermediate_size", norm_topk_prob="norm_topk_prob",
                            shared_experts=None, decoder_sparse_step="decoder_sparse_step",
                            mlp_only_layers="mlp_only_layers")),
)}

# HF keys that make a model mixture-of-experts in some family (a dense family refuses a config that sets one).
MOE_HF_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def family_of(name: str) -> ModelFamily:
    """The family called `name` (`model.family`, HF `model_type`); ValueError listing the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family: unsupported architecture {name!r}; supported: {sorted(FAMILIES)}") from None


def pop_retired_qkv_bias(model: MutableMapping[str, Any], where: str) -> None:
    """Remove `qkv_bias` from a model config written before the family decided it (old run configs, old
    model_config.yaml files): accepted when it is the family's, ValueError naming `where` otherwise."""
    if "qkv_bias" not in model:
        return
    saved, family = model.pop("qkv_bias"), family_of(str(model.get("family", "qwen2")))
    if bool(saved) != family.qkv_bias:
        raise ValueError(f"{where}: qkv_bias={saved} but the {family.name} family has qkv_bias={family.qkv_bias}")
