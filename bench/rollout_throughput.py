"""New tokens/s: the megatron rollout engine vs vLLM vs Hugging Face `generate`, same model, same weights.

The megatron GPTModel (local spec, fp32, TP=1, one process) is built from `--preset`; its weights
are mapped into a transformers `Qwen2ForCausalLM` with `convert.hf_mapping.megatron_to_hf`, and the
two models' logits are compared first (`max_logit_diff`) so both engines run the same function.
Both sample with temperature 1 and no EOS, so every row generates exactly `new_tokens` tokens; HF
gets left-padded prompts with an attention mask and `num_return_sequences=n`. The engine runs with
its default decode (`KVCacheStage`, rollout/kv_decode.py); `megatron_ref` is the same engine over
megatron's own `StaticInferenceContext` forward, for reference. The engines alternate within each of
`--repeats` rounds and the best wall-clock run of each is kept (the box is shared; best-of is the
least noisy statistic); the load average is recorded before and after.

vLLM (where importable: `make venv-vllm`) is built once through the production factory
(rollout/factory.py, fp32, enforce_eager, its CPU build here) from a config-only HF directory, gets the
weights by refit, and generates with the same prompts, n, temperature and lengths (its prefix cache is
reset before each run). Its start-up (build + first refit) is reported separately.

Presets: `tiny`, `small` (the default) and `smollm2` (SmolLM2-135M's shape, random weights, one scenario: a
training step's 8 prompts x 4 samples, 64 new tokens). Each row also gets the fp32 decode roofline at its batch
(bench/machine_peaks.py: the slower of reading every matmul weight once per step at the copy bandwidth and the
step's FLOPs at the fp32 GEMM peak, both measured before and after the runs, the best of the two kept) and each
engine's share of it.

Run: ``OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/rollout_throughput.py [--preset smollm2]`` (writes
bench/results/rollout_throughput.json, or rollout_throughput_<preset>.json; with .venv/bin/python the vLLM column is
absent). With ``VLLM_CPU_OMP_THREADS_BIND=nobind`` vLLM is not pinned to cores and runs one thread like the other
engines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

RESULTS = os.path.join(os.path.dirname(__file__), "results", "rollout_throughput.json")
sys.path.insert(0, os.path.dirname(__file__))
from machine_peaks import decode_roofline_tokens_per_s, measure_peaks  # noqa: E402

PRESETS = {  # name -> ModelConfig overrides
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 vocab_size=128, make_vocab_size_divisible_by=128),
    "small": dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2,
                  vocab_size=4096, make_vocab_size_divisible_by=128),
    # SmolLM2-135M-Instruct's shape (conf/model/smollm2_135m.yaml), random weights
    "smollm2": dict(family="llama", num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
                    num_query_groups=3, vocab_size=49152, make_vocab_size_divisible_by=128, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True),
}
SCENARIOS = {  # preset -> [(name, prompts, n, min prompt len, max prompt len, new tokens)]
    "tiny": [("16 prompts x n=1, len 16-48", 16, 1, 16, 48, 64), ("4 prompts x n=8, len 16-48", 4, 8, 16, 48, 64)],
    "small": [("16 prompts x n=1, len 16-48", 16, 1, 16, 48, 64), ("4 prompts x n=8, len 16-48", 4, 8, 16, 48, 64)],
    "smollm2": [("8 prompts x n=4, len 80-160 (a step)", 8, 4, 80, 160, 64)],
}


def decode_costs(cfg, dtype: str) -> dict:
    """Weight bytes a decode step reads (every matmul weight once, whatever the batch) and FLOPs per new token
    (2 per weight of every matmul: QKV, attention output, the SwiGLU MLP, the output layer). Attention over the
    cache (2 x 2 x context x heads x head_dim per layer) is left out: at these lengths it is < 5% of the FLOPs."""
    h, f, layers = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    head_dim = cfg.kv_channels or h // cfg.num_attention_heads
    qkv = h * (cfg.num_attention_heads + 2 * cfg.num_query_groups) * head_dim
    weights = layers * (qkv + cfg.num_attention_heads * head_dim * h + 3 * h * f) + h * cfg.vocab_size
    return {"matmul_weights": weights, "weight_bytes": weights * (4 if dtype == "fp32" else 2),
            "flops_per_token": 2 * weights}


def best_peaks(*measured: dict) -> dict:
    """Per quantity the best of the peak measurements taken around the runs: load only ever lowers a measured peak,
    so the best is the closest to what the machine can do."""
    keys = ("fp32_peak_gflops", "bf16_peak_gflops", "mem_bandwidth_gbs")
    return {k: max(m[k] for m in measured) for k in keys}


def add_rooflines(rows: list[dict], costs: dict, peaks: dict) -> None:
    """Each row's fp32 decode roofline (machine_peaks.decode_roofline_tokens_per_s at its batch) and each engine's
    share of it."""
    for row in rows:
        roof = decode_roofline_tokens_per_s(costs["weight_bytes"], costs["flops_per_token"], row["batch"], peaks,
                                            "fp32")
        row.update(roof)
        for key in [k for k in row if k.endswith("_tokens_per_second")]:
            row[key.replace("_tokens_per_second", "_share_of_roofline")] = row[key] / roof["roofline_tokens_per_s"]


def build_models(preset: str):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig
    from exgrpo_megatron.convert.hf_config import hf_config_from_model_config
    from exgrpo_megatron.convert.hf_mapping import megatron_to_hf
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.rollout.refit import iter_hf_weight_buckets

    init_distributed(1, 1, seed=3)
    cfg = ModelConfig(params_dtype="fp32", layer_spec="local", max_position_embeddings=512, **PRESETS[preset])
    gpt = build_gpt_model(cfg, ParallelConfig()).eval()
    hf_cfg = {k: v for k, v in hf_config_from_model_config(cfg, dtype="float32").items() if k != "architectures"}
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if cfg.family == "llama" else (Qwen2Config,
                                                                                                Qwen2ForCausalLM)
    hf = model_class(config_class(**hf_cfg)).eval()
    weights = {n: t for b in iter_hf_weight_buckets([gpt], cfg, 1 << 30, convert=megatron_to_hf) for n, t in b}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    tied = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    assert not unexpected and all("rotary" in m or m in tied for m in missing), (missing, unexpected)
    return cfg, gpt, hf


def max_logit_diff(cfg, gpt, hf) -> float:
    from exgrpo_megatron.model.builder import causal_attention_mask

    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = gpt(input_ids=ids, position_ids=torch.arange(24)[None].expand(2, 24),
                attention_mask=causal_attention_mask(24, 2))[..., : cfg.vocab_size]
        b = hf(input_ids=ids).logits
    return (a - b).abs().max().item()


def run_megatron(gpt, cfg, prompts, n, new_tokens, decode_impl: str = "auto") -> tuple[float, int]:
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams

    engine = MegatronRolloutEngine(gpt, vocab_size=cfg.vocab_size, max_batch_sequences=64, decode_impl=decode_impl)
    start = time.perf_counter()
    out = engine.generate(prompts, n, SamplingParams(max_new_tokens=new_tokens, seed=1))
    seconds = time.perf_counter() - start
    return seconds, sum(len(s.response_ids) for g in out for s in g)


def run_hf(hf, prompts, n, new_tokens) -> tuple[float, int]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.manual_seed(1)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_return_sequences=n,
                          pad_token_id=0, eos_token_id=None)
    seconds = time.perf_counter() - start
    return seconds, (out.shape[1] - width) * out.shape[0]


def build_vllm(gpt, cfg, hf_dir: str):
    """The vLLM engine via the production factory, or None where vLLM is not installed."""
    from exgrpo_megatron.config.schema import VllmConfig
    from exgrpo_megatron.convert.hf_config import hf_config_from_model_config
    from exgrpo_megatron.rollout.factory import build_rollout_engine, vllm_installed

    if not vllm_installed():
        return None, 0.0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.makedirs(hf_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf_config_from_model_config(cfg, "float32"), f)
    settings = VllmConfig(gpu_memory_utilization=0.05, enforce_eager=True, max_model_len=cfg.max_position_embeddings)
    start = time.perf_counter()
    engine = build_rollout_engine("vllm", gpt, cfg, None, vllm=settings, hf_dir=hf_dir, seed=1,
                                  max_model_len=cfg.max_position_embeddings, max_batch_sequences=64)
    return engine, time.perf_counter() - start


def run_vllm(engine, prompts, n, new_tokens) -> tuple[float, int]:
    from exgrpo_megatron.rollout.types import SamplingParams

    engine.llm.reset_prefix_cache()
    start = time.perf_counter()
    out = engine.generate(prompts, n, SamplingParams(max_new_tokens=new_tokens, seed=1))
    seconds = time.perf_counter() - start
    return seconds, sum(len(s.response_ids) for g in out for s in g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. how loaded the box was)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/rollout_throughput.json, "
                                                   "rollout_throughput_<preset>.json for other presets than small)")
    args = parser.parse_args()
    results = args.out or (RESULTS if args.preset == "small" else RESULTS.replace(".json", f"_{args.preset}.json"))
    torch.set_num_threads(args.threads)
    peaks = measure_peaks(args.threads)
    cfg, gpt, hf = build_models(args.preset)
    costs = decode_costs(cfg, "fp32")
    diff = max_logit_diff(cfg, gpt, hf)
    rng = random.Random(0)
    load_before = os.getloadavg()
    engines = {"megatron": lambda *a: run_megatron(gpt, cfg, *a), "hf": lambda *a: run_hf(hf, *a),
               "megatron_ref": lambda *a: run_megatron(gpt, cfg, *a, decode_impl="megatron")}
    import tempfile

    vllm, vllm_startup = build_vllm(gpt, cfg, os.path.join(tempfile.mkdtemp(), "hf"))
    if vllm is not None:
        engines["vllm"] = lambda *a: run_vllm(vllm, *a)
    rows = []
    for name, num_prompts, n, lo, hi, new_tokens in SCENARIOS[args.preset]:
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num_prompts)]
        runs: dict[str, list[tuple[float, int]]] = {engine: [] for engine in engines}
        for _ in range(args.repeats):
            for engine, fn in engines.items():
                runs[engine].append(fn(prompts, n, new_tokens))
        best = {}
        for engine, engine_runs in runs.items():
            seconds, tokens = min(engine_runs)
            best[engine] = {"seconds": seconds, "new_tokens": tokens, "tokens_per_second": tokens / seconds}
        speedup = best["megatron"]["tokens_per_second"] / best["hf"]["tokens_per_second"]
        row = {"scenario": name, "batch": num_prompts * n,
               **{f"{k}_{m}": v[m] for k, v in best.items() for m in v}, "speedup": speedup}
        if "vllm" in best:
            row["vllm_vs_megatron"] = best["vllm"]["tokens_per_second"] / best["megatron"]["tokens_per_second"]
        rows.append(row)
    load_after = os.getloadavg()
    peaks_after = measure_peaks(args.threads)
    add_rooflines(rows, costs, best_peaks(peaks, peaks_after))
    print(f"preset={args.preset} threads={args.threads} max|logit diff megatron-HF|={diff:.2e}")
    print(f"load average before {load_before}, after {load_after} ({os.cpu_count()} cores)")
    print(f"{'scenario':32s} {'megatron tok/s':>15s} {'HF tok/s':>10s} {'speedup':>8s} {'megatron_ref tok/s':>19s}"
          f" {'vLLM tok/s':>11s} {'vLLM/megatron':>14s}")
    for r in rows:
        print(f"{r['scenario']:32s} {r['megatron_tokens_per_second']:15.0f} {r['hf_tokens_per_second']:10.0f} "
              f"{r['speedup']:7.2f}x {r['megatron_ref_tokens_per_second']:19.0f}"
              f" {r.get('vllm_tokens_per_second', math.nan):11.0f} {r.get('vllm_vs_megatron', math.nan):13.2f}x")
    for r in rows:
        print(f"{r['scenario']}: roofline {r['roofline_tokens_per_s']:.0f} tok/s ({r['bound']} bound); megatron at "
              f"{r['megatron_share_of_roofline']:.0%} of it" + (f", vLLM at {r['vllm_share_of_roofline']:.0%}"
                                                                 if "vllm_share_of_roofline" in r else ""))
    print(f"machine peaks before {peaks}, after {peaks_after}")
    if vllm is not None:
        print(f"vLLM start-up (build + first refit, enforce_eager, CPU build): {vllm_startup:.1f} s")
    os.makedirs(os.path.dirname(results), exist_ok=True)
    with open(results, "w") as f:
        json.dump({"preset": args.preset, "model": PRESETS[args.preset], "threads": args.threads,
                   "repeats": args.repeats, "max_logit_diff": diff, "cpu_count": os.cpu_count(),
                   "load_average_before": load_before, "load_average_after": load_after,
                   "loaded": max(load_before[0], load_after[0]) > (os.cpu_count() or 1), "note": args.note,
                   "machine_peaks": peaks, "machine_peaks_after": peaks_after,
                   "roofline_peaks": best_peaks(peaks, peaks_after), "decode_costs_fp32": costs,
                   "vllm": None if vllm is None else {"version": _vllm_version(), "startup_seconds": vllm_startup,
                                                      "settings": "fp32, enforce_eager, CPU build (vllm-cpu)"},
                   "rows": rows}, f, indent=2)
    print(f"wrote {results}")


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "?"


if __name__ == "__main__":
    main()
