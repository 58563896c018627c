"""Does LoRA learn on the CPU demo as full fine-tuning does, across seeds? `demo_cpu` for 30 steps, full fine-tuning at
the preset's lr against LoRA rank 8, alpha 16 on all four targets at 10x that lr (docs/lora.md), at the same seeds:

    nice .venv/bin/python bench/lora_demo.py [--seeds 1234 1 2] [--steps 30]
    .venv/bin/python bench/lora_demo.py --analyse-only      # the table from the runs on disk

Each run trains in runs/lora_demo/<arm>_seed<seed> (a finished run is read, not re-run; an unfinished one resumes
from its checkpoint). Per run: the training reward's gain (mean reward/mean of the last 10 steps minus the first 10),
the validation score at the last step and the largest sampler/trainer mismatch. Per seed: LoRA's gain and
validation minus full fine-tuning's. Writes bench/results/lora_demo.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RUNS = os.path.join(REPO, "runs", "lora_demo")
RESULT = os.path.join(HERE, "results", "lora_demo.json")
ARMS: dict[str, tuple[str, ...]] = {
    "full": (),  # the preset's lr 1e-4
    "lora": ("lora.rank=8", "lora.alpha=16", "optim.lr=1e-3"),
}
WINDOW = 10  # steps averaged at each end of the reward curve


def run_dir(arm: str, seed: int) -> str:
    return os.path.join(RUNS, f"{arm}_seed{seed}")


def read_steps(path: str) -> list[dict]:
    """The run's step records in step order (read_metrics skips a torn last line; a step logged again after a resume
    keeps its last values)."""
    from exgrpo_megatron.logging.metrics import read_metrics

    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(metrics):
        return []
    by_step: dict[int, dict] = {}
    for row in read_metrics(metrics):
        if "step" in row:
            by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def train(arm: str, seed: int, steps: int) -> None:
    if len([r for r in read_steps(run_dir(arm, seed)) if "reward/mean" in r]) >= steps:
        return
    cmd = [sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu", f"seed={seed}",
           f"trainer.total_steps={steps}", "checkpoint.save_every=10", "logging.tensorboard=false",
           "logging.progress_bar=false", f"logging.run_dir={run_dir(arm, seed)}", *ARMS[arm]]
    print("[lora_demo]", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def summarize(arm: str, seed: int, steps: int) -> dict | None:
    rows = [r for r in read_steps(run_dir(arm, seed)) if "reward/mean" in r]
    if len(rows) < steps:
        return None
    rewards = [float(r["reward/mean"]) for r in rows[:steps]]
    val_keys = [k for k in rows[steps - 1] if k.startswith("val/")]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    mismatch = [float(r["mismatch/token_mult_prob_error"]) for r in rows if "mismatch/token_mult_prob_error" in r]
    return {"arm": arm, "seed": seed, "steps": steps, "reward_first": first, "reward_last": last,
            "gain": last - first, "val": float(rows[steps - 1][val_keys[0]]) if val_keys else None,
            "val_key": val_keys[0] if val_keys else None, "max_mismatch": max(mismatch) if mismatch else None,
            "rewards": rewards}


def analyse(seeds: list[int], steps: int) -> dict:
    runs = [s for arm in ARMS for seed in seeds if (s := summarize(arm, seed, steps)) is not None]
    by = {(r["arm"], r["seed"]): r for r in runs}
    paired = []
    for seed in seeds:
        full, lora = by.get(("full", seed)), by.get(("lora", seed))
        if full and lora:
            paired.append({"seed": seed, "gain_lora_minus_full": lora["gain"] - full["gain"],
                           "gain_ratio": lora["gain"] / full["gain"] if full["gain"] else None,
                           "val_lora_minus_full": (lora["val"] - full["val"]) if None not in (lora["val"], full["val"])
                           else None})
    return {"preset": "demo_cpu", "steps": steps, "window": WINDOW, "arms": {k: list(v) for k, v in ARMS.items()},
            "runs": runs, "paired": paired}


def print_table(result: dict) -> None:
    print("| arm | seed | reward first 10 -> last 10 | gain | validation at the last step | max mismatch |")
    print("|---|---|---|---|---|---|")
    for r in result["runs"]:
        val = "n/a" if r["val"] is None else f"{r['val']:.3f}"
        print(f"| {r['arm']} | {r['seed']} | {r['reward_first']:.3f} -> {r['reward_last']:.3f} | {r['gain']:+.3f} | "
              f"{val} | {r['max_mismatch']} |")
    for p in result["paired"]:
        ratio = "n/a" if p["gain_ratio"] is None else f"{p['gain_ratio']:.2f}"
        val = "n/a" if p["val_lora_minus_full"] is None else f"{p['val_lora_minus_full']:+.3f}"
        print(f"seed {p['seed']}: LoRA gain - full {p['gain_lora_minus_full']:+.3f} (ratio {ratio}), "
              f"validation {val}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--analyse-only", action="store_true")
    args = parser.parse_args()
    if not args.analyse_only:
        for seed in args.seeds:
            for arm in ARMS:
                train(arm, seed, args.steps)
    result = analyse(args.seeds, args.steps)
    os.makedirs(os.path.dirname(RESULT), exist_ok=True)
    with open(RESULT, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
