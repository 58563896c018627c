"""The GPU check pack's decode sections (bench/gpu_check.py runs them, each in its own process).

* ``decode_attention``: the engine's two attention paths over the KV cache (rollout/kv_decode.py) and the one it
  takes, timed at the 1.5B decode shape (512 rows, 12 query heads in 2 groups, head dim 128, 256 cached positions,
  bf16; bench/cache_attention.py's ``device_paths``).
* ``decode``: the megatron engine's decode at the Qwen2.5-1.5B shape (random weights, bf16, 64 prompts x 8 = 512
  rows, 128 new tokens, no EOS) and at the demo's Qwen3-MoE shape: the chunked loop (today's default), the
  continuous loop with an eager step, and with the step captured as CUDA graphs (on CUDA; the continuous loop
  refuses MoE models, recorded with its reason). Per arm: tokens/s, the first call's seconds (CUDA-graph capture
  included) and, with the section's own bf16 matmul peak and copy bandwidth, the fraction of the decode roofline
  (max of FLOPs / peak and weight bytes / bandwidth per step). ``--smoke``: a toy shape on the CPU, fp32, with the
  compiled step instead of graphs.
"""

from __future__ import annotations

import os
import time


def decode_attention(smoke: bool) -> dict:
    import torch
    from cache_attention import device_paths

    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() and not smoke else ("cpu", torch.float32)
    shape = dict(rows=4, heads=4, groups=2, head_dim=16, cached=16) if smoke else \
        dict(rows=512, heads=12, groups=2, head_dim=128, cached=256)
    return device_paths(device, dtype=dtype, calls=5 if smoke else 50, **shape)


DENSE_GPU = ["model=qwen2_5_math_1_5b", "model.hf_path=null", "model.params_dtype=bf16", "model.vocab_size=103"]
MOE_GPU = ["model=demo_qwen3_moe", "model.params_dtype=bf16"]
SMOKE = ["model.params_dtype=fp32"]


def _arm(engine, prompts: list[list[int]], n: int, new_tokens: int, repeats: int) -> dict:
    import torch

    from exgrpo_megatron.rollout.types import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, seed=1)
    timings = []
    for _ in range(repeats + 1):  # the first call warms (CUDA-graph capture, compilation, allocator)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, n, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    tokens = sum(len(s.response_ids) for g in out for s in g)
    return {"tokens": tokens, "first_call_s": timings[0], "tokens_per_s": tokens / min(timings[1:])}


def _shape(overrides: list[str], smoke: bool, peak: float, bandwidth: float) -> dict:
    import torch
    from gpu_check import matmul_flops_per_token

    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine

    cfg = load_config("demo_cpu", overrides)
    model = build_gpt_model(cfg.model, cfg.parallel)
    if torch.cuda.is_available() and not smoke:
        model = model.cuda()
    prompts_n, n, new_tokens = (2, 2, 6) if smoke else (64, 8, 128)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.model.vocab_size, (int(length),), generator=generator).tolist()
               for length in torch.randint(16, 64, (prompts_n,), generator=generator)]
    rows = prompts_n * n
    step_arms = {"chunked": {}, "continuous_eager": {"decode_loop": "continuous", "cuda_graphs": "false"},
                 "continuous_graphed" if not smoke else "continuous_compiled":
                     {"decode_loop": "continuous", **({"compile_decode": True} if smoke else {"cuda_graphs": "true"})}}
    flops = matmul_flops_per_token(cfg)
    weight_bytes = flops // 2 * (2 if cfg.model.params_dtype == "bf16" else 4)
    roofline_steps_per_s = 1.0 / max(flops * rows / peak, weight_bytes / bandwidth)
    out: dict = {"rows": rows, "new_tokens": new_tokens, "matmul_flops_per_token": flops,
                 "roofline_tokens_per_s": roofline_steps_per_s * rows}
    for name, loop in step_arms.items():
        try:
            engine = MegatronRolloutEngine(model, vocab_size=cfg.model.vocab_size, max_batch_sequences=rows,
                                           max_model_len=64 + new_tokens, **loop)
        except ValueError as exc:
            out[name] = {"refused": str(exc)}
            continue
        arm = _arm(engine, prompts, n, new_tokens, repeats=1 if smoke else 2)
        arm["share_of_roofline"] = arm["tokens_per_s"] / out["roofline_tokens_per_s"]
        out[name] = arm
    return out


def decode(smoke: bool) -> dict:
    """The `decode` section (module docstring)."""
    import torch
    from gpu_check import peaks

    from exgrpo_megatron.distributed.runtime import init_distributed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    init_distributed(1, 1, seed=3)
    measured = peaks(smoke)
    peak = measured["bf16_matmul_tflops" if torch.cuda.is_available() and not smoke else "fp32_matmul_tflops"] * 1e12
    bandwidth = measured["copy_gb_per_s"] * 1e9
    return {"peaks": measured,
            "dense_1_5b" if not smoke else "dense_demo": _shape(SMOKE if smoke else DENSE_GPU, smoke, peak, bandwidth),
            "moe_demo": _shape(["model=demo_qwen3_moe", *SMOKE] if smoke else MOE_GPU, smoke, peak, bandwidth)}
