"""Shared pieces of the vLLM suite: a tiny fp32 model's HF directory (config + the character tokenizer
as HF files) and, per rank, the policy + both rollout engines built through the production factory."""

from __future__ import annotations

import json
import os

import torch

from exgrpo_megatron.config.schema import ModelConfig, VllmConfig

# Small KV-cache share on the shared CPU machine: the CPU build's share is of RAM.
TEST_VLLM = VllmConfig(gpu_memory_utilization=0.05, enforce_eager=True, dtype="auto", max_model_len=96)


def tiny_model_config(tp: int = 1, params_dtype: str = "fp32", family: str = "qwen2") -> ModelConfig:
    """Qwen2 (QKV bias), or Qwen3 (QK-norm, head dim 32 != hidden / heads = 64)."""
    return ModelConfig(name=f"tiny_{family}", family=family, num_layers=2, hidden_size=128, ffn_hidden_size=256,
                       num_attention_heads=2, num_query_groups=2, kv_channels=32 if family == "qwen3" else None,
                       vocab_size=103, make_vocab_size_divisible_by=64, max_position_embeddings=128,
                       params_dtype=params_dtype, layer_spec="local")


def write_tiny_hf_dir(path: str, cfg: ModelConfig) -> str:
    """config.json (+ generation_config.json) and the character tokenizer; weights come by refit."""
    from exgrpo_megatron.convert.hf_config import hf_config_from_model_config
    from exgrpo_megatron.convert.hf_tokenizer import save_char_tokenizer, special_token_ids

    os.makedirs(path, exist_ok=True)
    save_char_tokenizer(path)
    ids = special_token_ids(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**hf_config_from_model_config(cfg, "float32"), **ids}, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(ids, f)
    return path


def perturb_(model, seed: int) -> None:
    """A weight change the engine must pick up: add noise to every parameter (same on every rank of a
    layout, since it is drawn per global name and full shape and then sliced like the weights are)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
