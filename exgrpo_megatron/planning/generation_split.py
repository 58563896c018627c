"""The GPU plan of generating one step ahead (rollout.max_staleness > 0), for the dry run: pure functions.

Model. A colocated run (max_staleness=0) on N GPUs spends G seconds generating and T seconds training per
step, each phase on all N GPUs: a step takes G + T. Generating ahead splits the GPUs: g generate while
N - g train, and each phase's time is assumed to scale inversely with its GPU count:

    gen(g) = G x N / g        train(g) = T x N / (N - g)        step(g) = max(gen(g), train(g))

(the slower side waits for the other). The best split is the g in 1..N-1 with the smallest step(g); ties go
to fewer generation GPUs. This release runs one generator process on one GPU: g = 1.

What the model implies: with x = g / N, step = max(G / x, T / (1 - x)) >= G + T, equal only at
x = G / (G + T) (both sides then take G + T). Under perfect scaling splitting the GPUs never beats the
colocated step; it matches it at best. A real gain comes from what the model leaves out: decoding scales
worse than linearly with GPUs (more sequences per GPU use it better), colocation pays the engine's
sleep/wake and weight refit every step and keeps the optimizer state resident beside the KV cache.
The dry run therefore reports the split as a ratio to the colocated step; measure before choosing.

Phase times come from a finished run (`read_phase_times`: the means of `time/generate` and `time/train` in
its metrics.jsonl, first step skipped: it includes compilation and cache warm-up), else DEFAULT_PHASE_TIMES.
They are taken as measured on the same N GPUs the plan is for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds per step of the two colocated phases, and where they come from."""

    generate: float
    train: float
    source: str
    measured: bool = True  # False: the default ratio (seconds of another model and machine; only ratios mean anything)

    @property
    def colocated(self) -> float:
        return self.generate + self.train


# The measured CPU ratio: bench/results/real_model_e2e.json, arm "megatron" (SmolLM2-135M, fp32, CPU, megatron
# engine, 40 steps), mean generate_s 21.34 s and train_s 19.09 s over steps 2-40. A tiny model on CPU with
# short responses: a GPU 7B run with 8k-token responses spends a larger share generating. Pass --phase-times.
DEFAULT_PHASE_TIMES = PhaseTimes(
    generate=21.34, train=19.09, measured=False,
    source="default: measured CPU ratio, bench/results/real_model_e2e.json arm megatron (SmolLM2-135M), steps 2-40")


@dataclass(frozen=True)
class Split:
    """g generation GPUs and N - g training GPUs, with the modelled phase and step seconds."""

    gen_gpus: int
    train_gpus: int
    generate: float
    train: float

    @property
    def step(self) -> float:
        return max(self.generate, self.train)


def split_times(times: PhaseTimes, n_gpus: int, gen_gpus: int) -> Split:
    """gen(g) = G x N / g, train(g) = T x N / (N - g), for 1 <= g <= N - 1."""
    if not 1 <= gen_gpus <= n_gpus - 1:
        raise ValueError(f"generation GPUs {gen_gpus}: expected 1..{n_gpus - 1} of {n_gpus}")
    return Split(gen_gpus, n_gpus - gen_gpus, times.generate * n_gpus / gen_gpus,
                 times.train * n_gpus / (n_gpus - gen_gpus))


def best_split(times: PhaseTimes, n_gpus: int) -> Split:
    """The g minimising max(gen(g), train(g)); ties: fewer generation GPUs. Needs N >= 2."""
    best = split_times(times, n_gpus, 1)
    for g in range(2, n_gpus):
        candidate = split_times(times, n_gpus, g)
        if candidate.step < best.step:
            best = candidate
    return best


def speedup(times: PhaseTimes, split: Split) -> float:
    """Colocated step (G + T) over the one-step-off step; < 1 is a slow-down."""
    return times.colocated / split.step


def mean_after_first(records: list[dict], key: str) -> float:
    """Mean of `key` over the records of every step but the first (the lowest step number)."""
    steps = sorted((int(r["step"]), float(r[key])) for r in records if key in r and "step" in r)
    values = [v for _, v in steps[1:]]
    if not values:
        raise ValueError(f"{key}: needs at least two steps that record it, found {len(steps)}")
    return sum(values) / len(values)


def read_phase_times(run_dir: str) -> PhaseTimes:
    """Means of time/generate and time/train in `<run_dir>/metrics.jsonl` (first step skipped); a torn or
    blank line is ignored. Raises ValueError naming the file when it is missing or too short."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"--phase-times: {path}: no such file (a run directory holds metrics.jsonl)")
    records = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    try:
        generate, train = mean_after_first(records, "time/generate"), mean_after_first(records, "time/train")
    except ValueError as err:
        raise ValueError(f"--phase-times: {path}: {err}") from err
    return PhaseTimes(generate, train, f"measured: {path}, mean over steps after the first")


def trainer_layout_ok(ranks: int, model_parallel: int, mini_batch: int) -> bool:
    """`ranks` training processes form a layout validate() accepts for the parallel sizes and batch: divisible
    by TP x PP x CP, and the PPO mini-batch divisible by the resulting DP size."""
    return ranks % model_parallel == 0 and mini_batch % (ranks // model_parallel) == 0


def _describe(times: PhaseTimes, s: Split, model_parallel: int, mini_batch: int) -> str:
    seconds = f" ({s.step:.1f} s: gen {s.generate:.1f} s, train {s.train:.1f} s)" if times.measured else ""
    valid = "" if trainer_layout_ok(s.train_gpus, model_parallel, mini_batch) else \
        (f"; NOTE {s.train_gpus} training ranks is not a valid layout (TP x PP x CP = {model_parallel}, "
         f"ppo_mini_batch_size {mini_batch})")
    return (f"g={s.gen_gpus} generate + {s.train_gpus} train: step {s.step / times.colocated:.2f} x colocated"
            f"{seconds}, speed-up x{speedup(times, s):.2f}{valid}")


def split_lines(times: PhaseTimes, n_gpus: int, model_parallel: int, mini_batch: int, active: bool) -> list[str]:
    """The dry run's section: the best split and this release's g = 1 against the colocated step G + T."""
    best, release = best_split(times, n_gpus), split_times(times, n_gpus, 1)
    share = f"generate share G/(G+T) = {times.generate / times.colocated:.2f}"
    if not active:
        return [f"hint: generating one step ahead (rollout.max_staleness=1) on {n_gpus} GPUs, perfect scaling: "
                f"best {_describe(times, best, model_parallel, mini_batch)}; this release (1 generator GPU): "
                f"speed-up x{speedup(times, release):.2f}; {share} ({times.source})"]
    colocated = f"{times.colocated:.1f} s" if times.measured else "G + T"
    return [
        f"generation one step ahead on N={n_gpus} GPUs (gen(g) = G*N/g, train(g) = T*N/(N-g), step = max; "
        "perfect scaling: at best equal to the colocated step, see planning/generation_split.py):",
        f"  phase times: {share}, colocated step {colocated} ({times.source})",
        f"  best split: {_describe(times, best, model_parallel, mini_batch)}",
        f"  this release (one generator process on one GPU): {_describe(times, release, model_parallel, mini_batch)}",
    ]
