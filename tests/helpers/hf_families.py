"""Tiny random-initialised HF models of every family, built by transformers' own classes (offline), saved with
`save_pretrained`: the references of the conversion, engine and vLLM tests."""

from __future__ import annotations

from typing import Any

import torch

SHAPE: dict[str, Any] = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
LLAMA3_ROPE: dict[str, Any] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Random values everywhere (norm weights and biases too), so a mis-mapped tensor changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def make_hf_model(family: str, out_dir: str, **overrides: Any):
    """The fp32 eval-mode model of `family` (perturbed), saved to `out_dir`. Qwen2: untied, QKV bias; Llama: tied,
    llama3 RoPE scaling; Qwen3: tied, QK-norm, head_dim 32 != hidden / heads = 16 (as Qwen3-0.6B / 4B / 14B)."""
    import transformers

    torch.manual_seed(0)
    kwargs: dict[str, Any] = {
        "qwen2": dict(rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256),
        "llama": dict(rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True,
                      max_position_embeddings=16384),
        "qwen3": dict(rope_theta=1e6, rms_norm_eps=1e-6, head_dim=32, tie_word_embeddings=True,
                      max_position_embeddings=256),
    }[family]
    prefix = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3"}[family]
    config = getattr(transformers, f"{prefix}Config")(**{**SHAPE, **kwargs, **overrides})
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float().eval()
    perturb(model, 1)
    model.save_pretrained(out_dir)
    return model
