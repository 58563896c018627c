"""Training forward+backward tokens/s on CPU: our megatron-core GPTModel vs transformers' Qwen2ForCausalLM.

Both models have IDENTICAL shape and weights (the megatron model is built with `build_gpt_model`, fp32,
local layer spec, TP=1, one gloo process; its weights are mapped into a `Qwen2ForCausalLM` with
`convert.hf_mapping.megatron_to_hf`, and the losses are compared). One step = forward on a [batch, seq] token
batch, mean next-token cross-entropy over every position, backward, zero grads. No optimizer step.

Each framework is trained through its own training call:
- `megatron`: `GPTModel(..., labels=labels)`, megatron-core's language-model loss (`vocab_parallel_cross_entropy`
  on its [s, b, V] logits; per-token losses [b, s], then the mean), core attention `model.core_attention=sdpa`
  (model/sdpa_attention.py, causal kernel, no mask tensor);
- `megatron_unfused`: the same with `model.fused_norm_rope=false` (torch's RMSNorm, megatron's RoPE): what the
  single-function RMSNorm and RoPE (model/fused_ops.py) are worth;
- `megatron_dpa`: the same with megatron's local `DotProductAttention`, the explicit causal mask and the unfused
  norm/RoPE (the path before the fused ones);
- `hf_sdpa` / `hf_eager`: `Qwen2ForCausalLM(input_ids).logits` then `F.cross_entropy` (what transformers'
  ForCausalLMLoss computes, without its label shift: labels are pre-shifted here), attention "sdpa" (the
  transformers default) or "eager" (matmul + softmax).
Two diagnostic megatron rows use the `megatron` model:
- `megatron_logits`: GPTModel without labels returns logits [b, s, V] (a transposed copy of its [s, b, V]
  output), then the same `F.cross_entropy` call as HF: what that transpose costs;
- `megatron_fused`: the RL trainer's output path (`trainer.fused_output_logprobs`, policy/output_layer.py): the
  model stops before its output layer and `fused_output_logprobs_entropy` computes the target log-probs chunk by
  chunk from the hidden states (no [tokens x V] logits; the output GEMM is recomputed in backward), loss = mean of
  -log p: the same loss, the price of never materialising the logits.

Contention: the box is shared, so the models are timed INTERLEAVED (one step of each model in turn, for
`--iters` rounds after `--warmup` rounds); a load spike hits all models alike. Reported per model: the MEDIAN
step time (tokens/s, MFU and the ratios use it) and the minimum. The fp32 GEMM
rate (`torch.matmul`, 2048 x 2048, same thread count) is measured before and after; the larger median is
used for MFU.

MFU = model FLOP/s / GEMM FLOP/s, with model FLOPs per token (fwd+bwd = 3 x forward):
    6 * N_matmul + 12 * L * s * d_attn
N_matmul = weights of every matmul (QKV, out proj, MLP, output layer; not the input embedding, norms or
biases); the second term is QK^T and AV over the full s x s score matrix (what both eager paths compute),
d_attn = heads * head_dim, s = sequence length. (`megatron_fused` does one more output-layer GEMM than counted.)

Peak RSS: every model is built and stepped (2 steps) in its OWN subprocess; a thread samples RSS every 2 ms;
reported are the sampled peak (imports of torch + transformers + megatron-core included) and "model+step" = that
peak minus the RSS right after imports (megatron's includes init_distributed: gloo group, RNG trackers).

Run: ``.venv/bin/python bench/train_throughput.py`` (writes bench/results/train_throughput.json): presets 8m
(h256 L4 V8k, 8.1M parameters) and 63m (h512 L8 V32k, 63.3M), batch 8 x 256, 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

RESULTS = os.path.join(os.path.dirname(__file__), "results", "train_throughput.json")
PRESETS = {  # name -> ModelConfig overrides
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 vocab_size=128, make_vocab_size_divisible_by=128),  # conf/model/tiny_qwen2.yaml
    "25m": dict(num_layers=6, hidden_size=512, ffn_hidden_size=1792, num_attention_heads=8, num_query_groups=2,
                vocab_size=4096, make_vocab_size_divisible_by=128),
    "8m": dict(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, num_query_groups=2,
               vocab_size=8000, make_vocab_size_divisible_by=64),  # 8.1M parameters
    "63m": dict(num_layers=8, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8, num_query_groups=2,
                vocab_size=32000, make_vocab_size_divisible_by=128),  # 63.3M parameters
}
# megatron* = our GPTModel (module docstring)
MODELS = ("megatron", "megatron_unfused", "megatron_dpa", "megatron_logits", "megatron_fused", "hf_sdpa", "hf_eager")
# megatron row -> (model.core_attention, model.fused_norm_rope) of the model it steps
MEGATRON_VARIANTS = {"megatron": ("sdpa", True), "megatron_unfused": ("sdpa", False),
                     "megatron_dpa": ("megatron", False), "megatron_logits": ("sdpa", True),
                     "megatron_fused": ("sdpa", True)}


def dtype_name() -> str:
    """The precision of both frameworks' models (`--dtype`, passed to the RSS subprocesses as BENCH_DTYPE)."""
    return os.environ.get("BENCH_DTYPE", "fp32")


def model_config(preset: str, core_attention: str = "sdpa", fused_norm_rope: bool = True):
    from exgrpo_megatron.config.schema import ModelConfig

    return ModelConfig(params_dtype=dtype_name(), layer_spec="local", max_position_embeddings=1024,
                       tie_word_embeddings=False, core_attention=core_attention, fused_norm_rope=fused_norm_rope,
                       **PRESETS[preset])


def build_megatron(preset: str, core_attention: str = "sdpa", fused_norm_rope: bool = True):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model

    init_distributed(1, 1, seed=3)
    cfg = model_config(preset, core_attention, fused_norm_rope)
    return cfg, build_gpt_model(cfg, ParallelConfig()).train()


def build_hf(cfg, attn: str, gpt=None):
    """Qwen2ForCausalLM of cfg's shape; with `gpt`, carrying its weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from exgrpo_megatron.convert.hf_config import hf_config_from_model_config

    torch_dtype = torch.bfloat16 if dtype_name() == "bf16" else torch.float32
    hf_cfg = {k: v for k, v in hf_config_from_model_config(cfg, dtype=str(torch_dtype).removeprefix("torch.")).items()
              if k != "architectures"}
    hf = Qwen2ForCausalLM(Qwen2Config(**hf_cfg, attn_implementation=attn)).to(torch_dtype).train()
    if gpt is not None:
        from exgrpo_megatron.convert.hf_mapping import megatron_to_hf
        from exgrpo_megatron.rollout.refit import iter_hf_weight_buckets

        buckets = iter_hf_weight_buckets([gpt], cfg, 1 << 30, convert=megatron_to_hf)
        weights = {n: t.clone() for b in buckets for n, t in b}
        missing, unexpected = hf.load_state_dict(weights, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def make_step(name: str, model, cfg, batch: int, seq: int):
    """A closure running one fwd+bwd step of `name`'s training call on a fixed random batch; returns the loss."""
    from exgrpo_megatron.model.builder import causal_attention_mask
    from exgrpo_megatron.policy.fused_logprobs import fused_output_logprobs_entropy
    from exgrpo_megatron.policy.output_layer import stop_before_output_layer

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(seq)[None].expand(batch, seq)
    # as Policy does: megatron's DotProductAttention gets the explicit mask, sdpa its causal kernel
    mask = causal_attention_mask(seq, batch) if name == "megatron_dpa" else None

    def loss_of_step() -> torch.Tensor:
        if name in ("megatron", "megatron_unfused", "megatron_dpa"):
            return model(input_ids=inputs, position_ids=positions, attention_mask=mask, labels=labels).mean()
        if name == "megatron_fused":
            with stop_before_output_layer(model, fused=True) as weight:
                hidden = model(input_ids=inputs, position_ids=positions, attention_mask=None)  # [s, b, H]
            logp, _ = fused_output_logprobs_entropy(hidden.transpose(0, 1).reshape(batch * seq, -1), weight,
                                                    labels.reshape(-1), cfg.vocab_size, with_entropy=False)
            return -logp.mean()
        logits = (model(input_ids=inputs, position_ids=positions, attention_mask=None) if name == "megatron_logits"
                  else model(input_ids=inputs).logits)
        return F.cross_entropy(logits[..., : cfg.vocab_size].reshape(-1, cfg.vocab_size).float(), labels.reshape(-1))

    def step() -> float:
        loss = loss_of_step()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def gemm_flops() -> float:
    """This run's GEMM peak in the benchmark's dtype (bench/machine_peaks.py), FLOP/s."""
    from machine_peaks import gemm_peak_gflops

    return gemm_peak_gflops(torch.bfloat16 if dtype_name() == "bf16" else torch.float32) * 1e9


def flops_per_token(cfg, seq: int) -> tuple[int, float]:
    """(N_matmul, fwd+bwd FLOPs per token) by the formula in the module docstring."""
    head = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    d_attn, d_kv = cfg.num_attention_heads * head, cfg.num_query_groups * head
    attn = cfg.hidden_size * (d_attn + 2 * d_kv) + d_attn * cfg.hidden_size
    per_layer = attn + 3 * cfg.hidden_size * cfg.ffn_hidden_size
    n_matmul = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size
    return n_matmul, 6.0 * n_matmul + 12.0 * cfg.num_layers * seq * d_attn


def rss_child(model_name: str, preset: str, batch: int, seq: int) -> None:
    """Subprocess body: build one model, 2 steps, print JSON with RSS numbers (MiB).

    `peak_rss_mib` = the highest RSS seen by a 2 ms sampling thread while building and stepping (imports
    included); `sampled_peak_minus_imports_mib` = that minus the RSS after imports. (ru_maxrss is useless here:
    Linux keeps it across fork+exec, so a child reports the parent's peak.)"""
    import threading

    import psutil

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401 - imports counted in the baseline

    from exgrpo_megatron.model import builder  # noqa: F401

    proc = psutil.Process()
    base = proc.memory_info().rss / 2**20
    sampled = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            sampled.append(proc.memory_info().rss / 2**20)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    if model_name in MEGATRON_VARIANTS:
        cfg, model = build_megatron(preset, *MEGATRON_VARIANTS[model_name])
    else:
        cfg = model_config(preset)
        model = build_hf(cfg, model_name.removeprefix("hf_"))
    step = make_step(model_name, model, cfg, batch, seq)
    step()
    step()
    done.set()
    thread.join()
    print(json.dumps({"rss_after_imports_mib": base, "peak_rss_mib": max(sampled),
                      "sampled_peak_minus_imports_mib": max(sampled) - base}))


def measure_rss(model_name: str, preset: str, batch: int, seq: int, threads: int) -> dict:
    env = dict(os.environ, BENCH_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    env.pop("MASTER_PORT", None)  # the parent's gloo store holds it
    out = subprocess.run([sys.executable, __file__, "--rss-child", model_name, "--preset", preset,
                          "--batch", str(batch), "--seq", str(seq)], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_preset(preset: str, batch: int, seq: int, warmup: int, iters: int, names: list[str]) -> dict:
    cfg, gpt = build_megatron(preset)
    models = {}
    for name in (n for n in names if n in MEGATRON_VARIANTS):  # rows of the default variant step `gpt` itself
        if MEGATRON_VARIANTS[name] == MEGATRON_VARIANTS["megatron"]:
            models[name] = gpt
        else:
            models[name] = build_megatron(preset, *MEGATRON_VARIANTS[name])[1]
            models[name].load_state_dict(gpt.state_dict())
    models.update({name: build_hf(cfg, name.removeprefix("hf_"), gpt) for name in names if name.startswith("hf_")})
    models = {name: models[name] for name in names}
    steps = {name: make_step(name, m, cfg, batch, seq) for name, m in models.items()}
    losses = {name: step() for name, step in steps.items()}  # also the first warm-up round
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(warmup - 1 + iters):
        for name in names:
            t0, c0 = time.perf_counter(), time.process_time()
            steps[name]()
            if rnd >= warmup - 1:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    n_params = sum(p.numel() for p in gpt.parameters())
    n_matmul, fpt = flops_per_token(cfg, seq)
    rows = {}
    for name in names:
        best, med = min(times[name]), statistics.median(times[name])
        rows[name] = {"min_step_s": best, "median_step_s": med, "tokens_per_s": batch * seq / med,
                      "median_cpu_s": statistics.median(cpu[name]), "cpu_times_s": cpu[name],
                      "tokens_per_s_best": batch * seq / best, "step_times_s": times[name],
                      "loss": losses[name], "model_flops_per_s": fpt * batch * seq / med}
    del models, steps, gpt
    return {"preset": preset, "model": PRESETS[preset], "params": n_params, "n_matmul": n_matmul,
            "flops_per_token": fpt, "batch": batch, "seq": seq, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="8m,63m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS), help=f"subset of {MODELS}, timed in this order")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--rss-child", choices=MODELS)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="both frameworks' model precision (bf16 writes train_throughput_bf16.json)")
    args = parser.parse_args()
    if args.dtype:
        os.environ["BENCH_DTYPE"] = args.dtype
    if args.rss_child:
        rss_child(args.rss_child, args.preset, args.batch, args.seq)
        return
    torch.set_num_threads(args.threads)
    gemm_before = gemm_flops()
    names = args.models.split(",")
    results = []
    presets = args.presets.split(",")
    for preset in presets:  # the JSON is rewritten after each preset, so a slow box keeps what finished
        results.append(bench_preset(preset, args.batch, args.seq, args.warmup, args.iters, names))
        done = len(results) == len(presets)
        report(args, gemm_before, max(gemm_before, gemm_flops()) if done else gemm_before, results, done)


def report(args, gemm_before: float, gemm: float, results: list[dict], complete: bool) -> None:
    for res in results:
        for name, row in res["rows"].items():
            row["mfu"] = row["model_flops_per_s"] / gemm
            if complete and not args.no_rss:
                row.update(measure_rss(name, res["preset"], args.batch, args.seq, args.threads))
        rows = res["rows"]
        for name in (n for n in MODELS if n.startswith("megatron")):
            for hf in ("hf_sdpa", "hf_eager"):
                if name in rows and hf in rows:
                    res[f"{name}_over_{hf}"] = rows[hf]["median_step_s"] / rows[name]["median_step_s"]
                    res[f"{name}_over_{hf}_cpu_time"] = rows[hf]["median_cpu_s"] / rows[name]["median_cpu_s"]
    dtype = dtype_name()
    print(f"threads={args.threads} batch={args.batch}x{args.seq} {dtype} GEMM peak={gemm / 1e9:.1f} GFLOP/s "
          f"load={os.getloadavg()[0]:.1f}")
    print(f"{'preset':6s} {'model':15s} {'params':>9s} {'tok/s':>9s} {'min s':>7s} {'med s':>7s} {'cpu s':>7s} "
          f"{'MFU':>6s} {'loss':>8s} "
          f"{'peakRSS MiB':>11s} {'model+step MiB':>14s}")
    for res in results:
        for name, r in res["rows"].items():
            print(f"{res['preset']:6s} {name:15s} {res['params']:9d} {r['tokens_per_s']:9.0f} {r['min_step_s']:7.3f} "
                  f"{r['median_step_s']:7.3f} {r['median_cpu_s']:7.3f} {r['mfu']:6.1%} {r['loss']:8.4f} "
                  f"{r.get('peak_rss_mib', float('nan')):11.0f} "
                  f"{r.get('sampled_peak_minus_imports_mib', float('nan')):14.0f}")
        for key, ratio in res.items():
            if "_over_" in key:
                print(f"{res['preset']:6s} {key} = {ratio:.2f}x")
    path = RESULTS if dtype == "fp32" else RESULTS.replace(".json", f"_{dtype}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": " ".join([".venv/bin/python", "bench/train_throughput.py", *sys.argv[1:]]),
                   "complete": complete, "threads": args.threads, "gemm_flops_per_s": gemm, "dtype": dtype,
                   f"{dtype}_peak_gflops": gemm / 1e9, "mfu": "model FLOP/s over this run's GEMM peak in the dtype",
                   "gemm_flops_before": gemm_before, "load_average_end": os.getloadavg(), "torch": torch.__version__,
                   "timing": f"interleaved rounds ({args.models}); tokens/s, MFU and ratios from the median step",
                   "results": results},
                  f, indent=2)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
