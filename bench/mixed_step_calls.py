"""A mixed step's generation in one engine call against one call per kind, at the SmolLM2-135M shape.

A mixed ExGRPO step generates K samples for each fresh question and K-1 for each replayed one
(rollout/groups.py). `one_call` is what the step does now: one `generate` with per-prompt sample counts.
`two_calls` generates the same rows as the step did before: the fresh prompts (n=K) in one call, then the
replayed prompts (n=K-1) in a second. Both draw the same rows with the same row seeds, so the samples agree
(checked here: same tokens; log-probs to 1e-5). The two arms alternate for `--repeats` rounds; per arm the best
wall time and the best process CPU time are kept (one thread: the CPU time is what the call takes on a core of
its own, the better number on a shared box).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/mixed_step_calls.py`` (writes bench/results/mixed_step_calls.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_profile import build_model  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "mixed_step_calls.json")


def timed(fn) -> tuple[float, float, list]:
    start, start_cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - start, time.process_time() - start_cpu, out


def main() -> None:
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--fresh", type=int, default=4, help="fresh prompts (K samples each)")
    ap.add_argument("--replayed", type=int, default=4, help="replayed prompts (K-1 samples each)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg, gpt = build_model(args.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(80, 160))]
               for _ in range(args.fresh + args.replayed)]
    counts = [args.k] * args.fresh + [args.k - 1] * args.replayed
    seeds = list(range(len(prompts)))
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=1)
    engine = MegatronRolloutEngine(gpt, vocab_size=cfg.vocab_size, max_batch_sequences=64)
    fresh, replayed = slice(0, args.fresh), slice(args.fresh, None)
    arms = {
        "one_call": lambda: engine.generate(prompts, counts, params, request_seeds=seeds),
        "two_calls": lambda: (engine.generate(prompts[fresh], args.k, params, request_seeds=seeds[fresh])
                              + engine.generate(prompts[replayed], args.k - 1, params, request_seeds=seeds[replayed])),
    }
    arms["one_call"]()  # warm-up
    load_before = os.getloadavg()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    samples = {}
    for _ in range(args.repeats):
        for name, fn in arms.items():
            wall, cpu, samples[name] = timed(fn)
            runs[name].append((wall, cpu))
    pairs = [(a, b) for ga, gb in zip(samples["one_call"], samples["two_calls"], strict=True)
             for a, b in zip(ga, gb, strict=True)]
    same_tokens = all(a.response_ids == b.response_ids for a, b in pairs)
    logprob_diff = max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs, strict=True))
    best = {name: {"wall_seconds": min(w for w, _ in r), "cpu_seconds": min(c for _, c in r)}
            for name, r in runs.items()}
    out = {"dtype": args.dtype, "rows": sum(counts), "fresh_prompts": args.fresh, "replayed_prompts": args.replayed,
           "k": args.k, "new_tokens": args.new_tokens, "repeats": args.repeats, "runs": runs, "best": best,
           "two_calls_over_one_call_wall": best["two_calls"]["wall_seconds"] / best["one_call"]["wall_seconds"],
           "two_calls_over_one_call_cpu": best["two_calls"]["cpu_seconds"] / best["one_call"]["cpu_seconds"],
           "same_tokens": same_tokens, "max_logprob_diff": logprob_diff, "load_average_before": load_before,
           "load_average_after": os.getloadavg(), "cpu_count": os.cpu_count(), "note": args.note}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
