"""Where the rollout engine's decode time goes, at the SmolLM2-135M shape, fp32 and bf16, one process.

The model is a megatron-core GPTModel with SmolLM2-135M-Instruct's shape (conf/model/smollm2_135m.yaml: 30 layers,
hidden 576, 9 heads / 3 KV heads, SwiGLU 1536, vocabulary 49152, tied embeddings) and random weights (the time of a
step does not depend on the weight values; no EOS is set, so every row generates all `--new-tokens`). The engine
(rollout/megatron_engine.py with its KV-cache stage, rollout/kv_decode.py) generates `--prompts` prompts x `--n`
samples (batch 32 by default) in one call, as a training step does.

Per precision: `--repeats` unprofiled calls (the best wall time is kept: the box is shared; with one thread the
call's process CPU time is also kept, compared with the peaks timed by CPU time) and one call under
`torch.profiler` (CPU activity). Every top-level torch op of the profiled call is put in one bucket:

- the phase: `prefill` (the engine's `prefill` range: the first forward of the chunk, every distinct prompt once,
  and the copy of its KV rows to the sample rows) or `decode` (the rest);
- the part: the innermost named range around it: a megatron module (forward hooks open a `record_function` range
  per module for the call: embedding, norms, linear_qkv, linear_proj, linear_fc1, linear_fc2, the SwiGLU between
  them, output_layer) or one of the engine's own ranges (`kv_decode.profile_range`, recorded only while a profiler
  runs): `attention` (over the cache: QK^T, masked fp32 softmax, PV), `rope`, `cache_write`, `sampling`,
  `select_rows` (KV rows of finished rows dropped); `other` is the rest (mask building, residual adds, token moves).

Per-token Python and dispatch overhead = the profiled decode wall time minus the time inside torch ops (summed over
top-level ops): the Python of the engine loop and of megatron's module calls (the counter-based uniforms, per-row
bookkeeping, hooks, the profiler's own per-op cost, which inflates it). Times are per decode step (one new token
for every row). The machine's fp32/bf16 GEMM peaks and memory bandwidth are measured in the same run
(bench/machine_peaks.py) and give each phase's roofline.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/decode_profile.py`` (writes bench/results/decode_profile.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from machine_peaks import decode_roofline_tokens_per_s, measure_peaks  # noqa: E402
from rollout_throughput import PRESETS, decode_costs  # noqa: E402

SMOLLM2 = PRESETS["smollm2"]

RESULTS = os.path.join(os.path.dirname(__file__), "results", "decode_profile.json")
MODULE_PARTS = ("embedding", "input_layernorm", "pre_mlp_layernorm", "final_layernorm", "linear_qkv", "linear_proj",
                "linear_fc1", "linear_fc2", "mlp", "output_layer")
ENGINE_PARTS = ("sampling", "attention", "rope", "cache_write", "select_rows")  # the engine's own profile_range names


def build_model(dtype: str):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    import torch.distributed as dist

    from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    if not dist.is_initialized():
        init_distributed(1, 1, seed=3)
    cfg = ModelConfig(name="smollm2_135m_shape", params_dtype=dtype, layer_spec="local", max_position_embeddings=512,
                      **SMOLLM2)
    return cfg, build_gpt_model(cfg, ParallelConfig()).eval()


class ModuleRanges:
    """Forward hooks opening a profiler range named after each module's part (MODULE_PARTS) for the call."""

    def __init__(self, model) -> None:
        self.handles, self.open = [], []
        for name, module in model.named_modules():
            part = name.rsplit(".", 1)[-1]
            if part in MODULE_PARTS:
                self.handles.append(module.register_forward_pre_hook(self._enter(part)))
                self.handles.append(module.register_forward_hook(self._exit))

    def _enter(self, part: str):
        def hook(module, args):
            rf = torch.profiler.record_function(part)
            rf.__enter__()
            self.open.append(rf)
        return hook

    def _exit(self, module, args, output) -> None:
        self.open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


RANGES = frozenset((*MODULE_PARTS, *ENGINE_PARTS, "prefill"))


def bucket(event) -> tuple[str, str]:
    """(phase, part) of a top-level op: the innermost named range around it, the phase from the `prefill` range."""
    part, phase = None, "decode"
    parent = event.cpu_parent
    while parent is not None:
        if part is None and parent.name in RANGES and parent.name != "prefill":
            part = parent.name
        if parent.name == "prefill":
            phase = "prefill"
        parent = parent.cpu_parent
    part = part or "other"
    return phase, "swiglu" if part == "mlp" else part  # in the MLP, outside its two linear layers


def profile_call(engine, prompts, n, params) -> dict:
    from torch.profiler import ProfilerActivity, profile

    ranges = ModuleRanges(engine.model)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            engine.generate(prompts, n, params)
            wall = time.perf_counter() - start
    finally:
        ranges.remove()
    events = list(prof.events())
    prefill = [e for e in events if e.name == "prefill"]
    times: dict[str, dict[str, float]] = {"prefill": defaultdict(float), "decode": defaultdict(float)}
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        if e.name in RANGES:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name in RANGES:
            parent = parent.cpu_parent
        if parent is not None:  # not top-level: its time is inside its parent op's
            continue
        phase, part = bucket(e)
        times[phase][part] += e.cpu_time_total / 1e6
        counts[phase] += 1
    prefill_wall = sum(e.cpu_time_total for e in prefill) / 1e6
    return {"wall_seconds": wall, "prefill_wall_seconds": prefill_wall, "decode_wall_seconds": wall - prefill_wall,
            "op_seconds": {k: dict(v) for k, v in times.items()}, "top_level_ops": dict(counts)}


def run_precision(dtype: str, args, peaks: dict, cpu_peaks: dict) -> dict:
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams

    cfg, gpt = build_model(dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1)
    engine = MegatronRolloutEngine(gpt, vocab_size=cfg.vocab_size, max_batch_sequences=args.prompts * args.n)
    engine.generate(prompts, args.n, params)  # warm-up (oneDNN kernel choice, allocator)
    walls, cpu = [], []
    for _ in range(args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.generate(prompts, args.n, params)
        walls.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    prof = profile_call(engine, prompts, args.n, params)
    batch, steps = args.prompts * args.n, args.new_tokens - 1  # the first token is sampled from the prefill logits
    costs = decode_costs(cfg, dtype)
    costs["prefill_flops"] = costs["flops_per_token"] * sum(len(p) for p in prompts)
    decode_ops = sum(prof["op_seconds"]["decode"].values())
    per_step = {part: s / steps * 1e3 for part, s in sorted(prof["op_seconds"]["decode"].items(), key=lambda x: -x[1])}
    per_step["python_and_dispatch"] = (prof["decode_wall_seconds"] - decode_ops) / steps * 1e3
    roof = decode_roofline_tokens_per_s(costs["weight_bytes"], costs["flops_per_token"], batch, peaks, dtype)
    cpu_roof = decode_roofline_tokens_per_s(costs["weight_bytes"], costs["flops_per_token"], batch, cpu_peaks, dtype)
    best = min(walls)
    tokens = batch * args.new_tokens
    return {"dtype": dtype, "batch": batch, "new_tokens": args.new_tokens, "walls_seconds": walls,
            "cpu_seconds": cpu, "best_cpu_tokens_per_second": tokens / min(cpu),
            "cpu_roofline_tokens_per_s": cpu_roof["roofline_tokens_per_s"], "cpu_bound": cpu_roof["bound"],
            "cpu_share_of_roofline": tokens / min(cpu) / cpu_roof["roofline_tokens_per_s"],
            "best_tokens_per_second": tokens / best, **costs, **roof,
            "share_of_roofline": tokens / best / roof["roofline_tokens_per_s"],
            "profiled": prof, "decode_step_ms_profiled": prof["decode_wall_seconds"] / steps * 1e3,
            "decode_ms_per_step_by_part": per_step,
            "prefill_ms_by_part": {k: v * 1e3 for k, v in prof["op_seconds"]["prefill"].items()},
            "prefill_flops_share_of_peak": costs["prefill_flops"] / prof["prefill_wall_seconds"]
            / (peaks[f"{dtype}_peak_gflops"] * 1e9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=80)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    peaks, cpu_peaks = measure_peaks(args.threads), measure_peaks(args.threads, clock="cpu")
    rows = [run_precision(d, args, peaks, cpu_peaks) for d in args.dtypes.split(",")]
    peaks_after = measure_peaks(args.threads)
    for r in rows:
        print(f"{r['dtype']}: best {r['best_tokens_per_second']:.0f} tok/s = {r['share_of_roofline']:.0%} of the "
              f"{r['bound']}-bound roofline {r['roofline_tokens_per_s']:.0f} (by CPU time: "
              f"{r['best_cpu_tokens_per_second']:.0f} tok/s = {r['cpu_share_of_roofline']:.0%} of "
              f"{r['cpu_roofline_tokens_per_s']:.0f}, {r['cpu_bound']} bound); profiled decode step "
              f"{r['decode_step_ms_profiled']:.1f} ms, prefill {r['profiled']['prefill_wall_seconds'] * 1e3:.0f} ms")
        for part, ms in r["decode_ms_per_step_by_part"].items():
            print(f"   {part:22s} {ms:7.2f} ms/step")
    out = {"threads": args.threads, "cpu_count": os.cpu_count(), "load_average_before": load_before,
           "load_average_after": os.getloadavg(), "note": args.note, "machine_peaks": peaks,
           "machine_peaks_cpu_clock": cpu_peaks, "machine_peaks_after": peaks_after, "model": SMOLLM2, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
