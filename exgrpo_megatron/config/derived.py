"""Values derived from the config that several layers need, as pure functions of config values.

The model builder, the checkpoint converter, the dry run and validation all pad the vocabulary the same
way; the builder, the vLLM engine factory and validation resolve `model.params_dtype=auto` and
`rollout.vllm.dtype` the same way, and the builder, the policy and validation `model.layer_spec=auto`. They live
here, at the bottom layer, so config/ imports nothing above it (model/ and rollout/ import these).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from exgrpo_megatron.config.schema import ModelConfig, TrainerConfig
from exgrpo_megatron.machine.cpu_precision import cpu_auto_is_bf16, this_cpu_bf16_unit
from exgrpo_megatron.machine.transformer_engine import transformer_engine_available

if TYPE_CHECKING:
    import torch

# rollout.vllm.dtype (other than auto) -> vLLM's `dtype` argument
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def head_dim(m: ModelConfig) -> int:
    """Each attention head's size: `model.kv_channels`, or hidden_size / num_attention_heads when it is null."""
    return m.kv_channels or m.hidden_size // m.num_attention_heads


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int = 1) -> int:
    """The vocabulary padded to a multiple of `divisible_by`. Unlike Megatron-LM (which pads to
    divisible_by x TP) the padding does not depend on TP, so a model is the same function at
    every layout; validation requires the padded size to be divisible by TP."""
    padded = int(math.ceil(vocab_size / divisible_by) * divisible_by)
    if padded % tp_size:
        raise ValueError(f"model.make_vocab_size_divisible_by: padded vocab {padded} is not divisible by TP={tp_size}")
    return padded


def resolve_params_dtype(cfg: ModelConfig) -> torch.dtype:
    """`model.params_dtype`: auto = bf16 on GPU; on CPU bf16 where the CPU has bf16 matrix units and the model is
    large enough (machine/cpu_precision.py), else fp32."""
    import torch

    if cfg.params_dtype == "auto":
        if torch.cuda.is_available():
            return torch.bfloat16
        return torch.bfloat16 if cpu_auto_is_bf16(this_cpu_bf16_unit(), cfg.hidden_size) else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.params_dtype]


def resolve_layer_spec(cfg: ModelConfig, te_available: bool | None = None) -> str:
    """`model.layer_spec`: auto = te where Transformer Engine imports with CUDA present (`te_available`; None:
    ask this machine), else local."""
    if cfg.layer_spec != "auto":
        return cfg.layer_spec
    if te_available is None:
        te_available = transformer_engine_available()
    return "te" if te_available else "local"


def vllm_dtype(setting: str, policy_dtype: torch.dtype) -> str:
    """vLLM's `dtype` argument: `auto` follows the policy's parameter dtype, so rollout and trainer
    log-probs come from the same precision (a bf16 engine against an fp32 policy skews the ratio)."""
    import torch

    if setting != "auto":
        return VLLM_DTYPES[setting]
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[policy_dtype]


def updates_per_step(t: TrainerConfig) -> int:
    """Mini-batch updates per pass over the step's rollouts: train_batch_size / ppo_mini_batch_size (the paper: 2)."""
    return max(1, t.train_batch_size // t.ppo_mini_batch_size)


def optimizer_updates_per_step(t: TrainerConfig) -> int:
    """Optimizer updates per RL step: `trainer.update_epochs` passes x `updates_per_step` mini-batch updates."""
    return updates_per_step(t) * max(1, t.update_epochs)
