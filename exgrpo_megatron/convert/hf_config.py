"""Translate between a HuggingFace `config.json` and our `ModelConfig`, for the families of config/families.py.

Mapping: model_type -> family, num_hidden_layers -> num_layers, intermediate_size -> ffn_hidden_size,
num_key_value_heads -> num_query_groups, head_dim -> kv_channels, rms_norm_eps, rope_theta,
tie_word_embeddings; a key config.json leaves out takes the family's default (HF's config class default).
What the family fixes (q/k/v bias, QK-norm) is not a ModelConfig field. RoPE scaling must be one the family
allows and exactly what megatron-core implements (Llama 3.1: `rope_type` llama3, low/high frequency factors 1
and 4, original context 8192); anything else is refused rather than silently converted, and so is a sliding window
(the family's keys, config/families.py SlidingWindowKeys). Every refusal names the HF key first (`key: value: why`);
the CLIs print it and exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import yaml

from exgrpo_megatron.config.derived import head_dim
from exgrpo_megatron.config.families import (
    FAMILIES,
    MOE_HF_KEYS,
    ModelFamily,
    MoEKeys,
    SlidingWindowKeys,
    family_of,
    pop_retired_qkv_bias,
)
from exgrpo_megatron.config.schema import ModelConfig

MODEL_CONFIG_FILE = "model_config.yaml"
# megatron-core's fixed llama3 RoPE scaling constants (RotaryEmbedding._apply_scaling defaults).
MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedArchitectureError(ValueError):
    """The HF model (or checkpoint) uses a feature this converter/trainer does not implement; the message names the
    HF key (or the CLI option) first."""


def _rope_key(hf: dict[str, Any]) -> str:
    return "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"


def _rope_dict(hf: dict[str, Any], family: ModelFamily) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either the legacy keys or transformers-5 `rope_parameters`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or None
    theta = float(hf.get("rope_theta", params.get("rope_theta", family.rope_theta_default)))  # type: ignore[arg-type]
    rope_type = (scaling or params).get("rope_type", (scaling or params).get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    return theta, dict(scaling or params)


def _rope_scaling_factor(hf: dict[str, Any], family: ModelFamily) -> float | None:
    _, scaling = _rope_dict(hf, family)
    if scaling is None:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in family.rope_scaling:
        raise UnsupportedArchitectureError(
            f"{_rope_key(hf)}: rope scaling type {rope_type!r} is unsupported for {family.name}; supported: "
            f"{list(family.rope_scaling)} (megatron-core implements only 'llama3', for Llama 3.1)"
        )
    for key, expected in MCORE_LLAMA3_ROPE.items():
        got = scaling.get(key)
        if got is None or float(got) != expected:
            raise UnsupportedArchitectureError(
                f"{_rope_key(hf)}.{key}: {got!r}: llama3 rope scaling differs from megatron-core's fixed value "
                f"{expected}")
    return float(scaling["factor"])


def check_supported(hf: dict[str, Any]) -> None:
    """Raise UnsupportedArchitectureError naming the first unsupported feature of an HF config dict."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"model_type: {model_type!r} (architectures={hf.get('architectures')}) is unsupported; "
            f"supported: {sorted(FAMILIES)}"
        )
    family = FAMILIES[model_type]
    for key in MOE_HF_KEYS:
        if hf.get(key) and family.moe is None:
            raise UnsupportedArchitectureError(f"{key}: {hf[key]}: mixture-of-experts is unsupported for {model_type}")
    if hf.get("hidden_act", family.activation) != family.activation:
        raise UnsupportedArchitectureError(
            f"hidden_act: {hf['hidden_act']!r} is unsupported; {model_type} is {family.activation} (gated)")
    if hf.get("attention_bias"):
        raise UnsupportedArchitectureError("attention_bias: True (bias on o_proj as well as q/k/v) is unsupported")
    if hf.get("mlp_bias"):
        raise UnsupportedArchitectureError("mlp_bias: True is unsupported")
    if family.sliding_window is not None:
        key, layers = windowed_layers(hf, family.sliding_window)
        if layers:
            raise UnsupportedArchitectureError(
                f"{key}: {hf.get(key)!r} enables sliding-window attention on layers {layers} (a window of "
                f"{hf.get(family.sliding_window.size, family.sliding_window.size_default)} tokens): unsupported, our "
                "models attend to every earlier token")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedArchitectureError(f"pretraining_tp: {hf['pretraining_tp']} is unsupported")
    _rope_scaling_factor(hf, family)
    if family.moe is not None:
        _check_moe_layout(hf, family.moe)


def windowed_layers(hf: dict[str, Any], keys: SlidingWindowKeys) -> tuple[str, list[int]]:
    """(the HF key that enables the window, the layers it windows) as the family's HF model class reads config.json;
    no layer: the config enables no window."""
    n = int(hf["num_hidden_layers"])
    if keys.layer_types and hf.get(keys.layer_types):
        return keys.layer_types, [i for i, t in enumerate(hf[keys.layer_types]) if t != "full_attention"]
    enabled = bool(hf.get(keys.enable, keys.enable_default)) if keys.enable else True
    if not enabled or hf.get(keys.size, keys.size_default) is None:
        return keys.enable or keys.size, []
    first = hf.get(keys.first_windowed_layer) if keys.first_windowed_layer else 0
    first = keys.first_windowed_layer_default if first is None else int(first)
    return keys.enable or keys.size, list(range(first, n))


def _check_moe_layout(hf: dict[str, Any], keys: MoEKeys) -> None:
    """Every decoder layer a mixture of experts (our builder's MoE layout); no shared expert; 1 <= top-k <= experts."""
    if keys.decoder_sparse_step and int(hf.get(keys.decoder_sparse_step, 1)) != 1:
        raise UnsupportedArchitectureError(f"{keys.decoder_sparse_step}: {hf[keys.decoder_sparse_step]}: only models "
                                           "whose every layer is a mixture of experts are supported")
    if keys.mlp_only_layers and hf.get(keys.mlp_only_layers):
        raise UnsupportedArchitectureError(f"{keys.mlp_only_layers}: {hf[keys.mlp_only_layers]}: dense layers in an "
                                           "MoE model are unsupported")
    if keys.shared_experts and hf.get(keys.shared_experts):
        raise UnsupportedArchitectureError(f"{keys.shared_experts}: {hf[keys.shared_experts]}: shared experts are "
                                           "unsupported")
    experts_key = keys.num_experts if keys.num_experts in hf else "num_local_experts"
    experts, top_k = hf.get(experts_key), hf.get(keys.top_k)
    if experts is None or top_k is None:
        raise UnsupportedArchitectureError(f"{keys.num_experts if experts is None else keys.top_k}: missing from "
                                           "config.json")
    if not 1 <= int(top_k) <= int(experts):
        raise UnsupportedArchitectureError(f"{keys.top_k}: {top_k} experts per token, but {experts_key}={experts}: "
                                           "the top-k must be between 1 and the number of experts")


def _moe_fields_from_hf(hf: dict[str, Any], keys: MoEKeys | None) -> dict[str, Any]:
    if keys is None:
        return {}
    # transformers 5 writes `num_experts` under its attribute-map name `num_local_experts`; Qwen's own files use
    # `num_experts`
    experts = hf[keys.num_experts] if keys.num_experts in hf else hf["num_local_experts"]
    return {"num_experts": int(experts), "moe_router_topk": int(hf[keys.top_k]),
            "moe_ffn_hidden_size": int(hf[keys.moe_intermediate_size]),
            "norm_topk_prob": bool(hf.get(keys.norm_topk_prob, False)) if keys.norm_topk_prob else True,
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}


def _moe_fields_to_hf(cfg: ModelConfig, keys: MoEKeys | None) -> dict[str, Any]:
    if keys is None:
        return {}
    out: dict[str, Any] = {keys.num_experts: cfg.num_experts, keys.top_k: cfg.moe_router_topk,
                           keys.moe_intermediate_size: cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                           "router_aux_loss_coef": cfg.moe_aux_loss_coeff, "output_router_logits": False}
    if keys.norm_topk_prob:
        out[keys.norm_topk_prob] = cfg.norm_topk_prob
    if keys.decoder_sparse_step:
        out[keys.decoder_sparse_step] = 1
    if keys.mlp_only_layers:
        out[keys.mlp_only_layers] = []
    return out


def model_config_from_hf(hf_config: dict[str, Any], hf_path: str | None = None) -> ModelConfig:
    """ModelConfig for an HF config dict of a known family; raises UnsupportedArchitectureError otherwise."""
    check_supported(hf_config)
    family = FAMILIES[hf_config["model_type"]]
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    dim = hf_config.get("head_dim") or family.head_dim_default
    theta, _ = _rope_dict(hf_config, family)
    return ModelConfig(
        name=os.path.basename(str(hf_config.get("_name_or_path") or hf_path or hf_config["model_type"]).rstrip("/")),
        family=hf_config["model_type"],
        num_layers=int(hf_config["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(hf_config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf_config.get("num_key_value_heads") or heads),
        kv_channels=int(dim) if dim is not None and int(dim) != hidden // heads else None,
        vocab_size=int(hf_config["vocab_size"]),
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling_factor=_rope_scaling_factor(hf_config, family),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", family.rms_norm_eps_default)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", family.tie_word_embeddings_default)),
        hf_path=hf_path,
        **_moe_fields_from_hf(hf_config, family.moe),
    )


def hf_config_from_model_config(
    cfg: ModelConfig, dtype: str = "bfloat16", base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """HF config.json dict for `cfg`. `base` (e.g. the original HF config) keeps token ids and other
    non-architecture keys; every architecture key is overwritten from `cfg`."""
    try:
        family = family_of(cfg.family)
    except ValueError as e:
        raise UnsupportedArchitectureError(str(e)) from None
    if cfg.rope_scaling_factor is not None and "llama3" not in family.rope_scaling:
        raise UnsupportedArchitectureError(f"{cfg.family} has no llama3 RoPE scaling (model.rope_scaling_factor)")
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    out.update(
        architectures=[family.hf_architecture],
        model_type=family.name,
        hidden_act=family.activation,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=None,
        tie_word_embeddings=cfg.tie_word_embeddings,
        torch_dtype=dtype,
        dtype=dtype,
    )
    out.update(family.hf_fixed_keys)
    out.update(_moe_fields_to_hf(cfg, family.moe))
    if family.hf_writes_head_dim or head_dim(cfg) != cfg.hidden_size // cfg.num_attention_heads:
        out["head_dim"] = head_dim(cfg)
    out.setdefault("use_cache", True)
    out.setdefault("initializer_range", cfg.init_method_std)
    window = family.sliding_window
    if window is not None:  # written switched off, whatever the original config.json said
        out[window.size] = None
        if window.enable:
            out[window.enable] = False
        if window.first_windowed_layer:
            out[window.first_windowed_layer] = cfg.num_layers
        if window.layer_types:
            out[window.layer_types] = ["full_attention"] * cfg.num_layers
    if cfg.rope_scaling_factor is not None:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **MCORE_LLAMA3_ROPE}
    return out


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir} has no config.json; not a HuggingFace model directory")
    with open(path) as f:
        return json.load(f)


def save_model_config(cfg: ModelConfig, directory: str) -> str:
    """Write `model_config.yaml` (the flat ModelConfig fields) into `directory`."""
    path = os.path.join(directory, MODEL_CONFIG_FILE)
    with open(path, "w") as f:
        yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)
    return path


def load_model_config(path: str) -> ModelConfig:
    """Read a `model_config.yaml` (flat ModelConfig fields, or nested under a `model:` key). One written before the
    family decided the q/k/v bias carries `qkv_bias`: accepted when it is the family's."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if set(data) == {"model"} and isinstance(data["model"], dict):
        data = data["model"]
    try:
        pop_retired_qkv_bias(data, path)
    except ValueError as exc:
        raise UnsupportedArchitectureError(str(exc)) from None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown ModelConfig keys {unknown}")
    return ModelConfig(**data)
