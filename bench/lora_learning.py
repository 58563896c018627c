"""Does LoRA learn as full fine-tuning does on the real model? SmolLM2-135M-Instruct, ExGRPO on the shipped word
problems (`smollm2_word_problems`, fp32), LoRA against full fine-tuning at the same seeds and steps:

    nice .venv/bin/python bench/lora_learning.py [--steps 20] [--seeds 1] [--rank 32 --alpha 32 --lr 2e-5]
    .venv/bin/python bench/lora_learning.py --analyse-only       # the table from the runs on disk

The full fine-tuning runs are bench/precision_learning.py's `fp32` arm: its record in
bench/results/precision_learning.json is reused where it holds the seed at the same number of steps (the preset at
its own lr), otherwise that arm is run here. The LoRA arm runs the same preset with `lora.rank`, `lora.alpha` (all
four targets) and `optim.lr` (LoRA wants about 10x full fine-tuning's learning rate, docs/lora.md). Each run is
trained resumably, exported to HF with the adapters merged (fp32) and evaluated greedily on the 48 validation
problems (precision_learning.run_one). Both arms sample step 1 from the same weights (B starts at 0), so their
step-1 rewards are equal when the settings match: `same_first_step` checks that the record is comparable.

Writes bench/results/lora_learning.{json,md}: per arm the fresh-reward curve, its rise (the mean of the last half
of the steps minus the first half, per seed), the greedy evaluation after training, the seconds per step, and the
LoRA arm's paired difference against full fine-tuning. `--partial`: the steps an unfinished run has logged so far
against the same first steps of full fine-tuning (lora_learning_partial.json, no evaluation).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from precision_learning import analyse, mean, run_one, table
from real_model_e2e import load_steps, prepare

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "lora_learning")
FULL_RECORD = os.path.join(HERE, "results", "precision_learning.json")
FULL_ARM = "fp32"  # precision_learning's full fine-tuning arm (analyse() compares every arm with it)


def lora_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """The LoRA arm's overrides. The GGUF-built HF config holds rms_norm_eps as the float32 nearest 1e-5
    (9.999999747e-06), which the start-up check reads as a change from the preset's 1e-05: the same number in fp32."""
    return ("model.params_dtype=fp32", f"lora.rank={args.rank}", f"lora.alpha={args.alpha}", f"optim.lr={args.lr}",
            "checkpoint.allow_model_changes=[rms_norm_eps]")


def recorded_full_runs(steps: int) -> dict[int, dict]:
    """precision_learning's fp32 runs at `steps` steps, by seed."""
    if not os.path.isfile(FULL_RECORD):
        return {}
    with open(FULL_RECORD) as f:
        record = json.load(f)
    return {r["seed"]: r for r in record.get("runs", [])
            if r["arm"] == FULL_ARM and len(r["steps"]["step"]) == steps}


def rise(run: dict) -> float:
    """Mean fresh reward of the last half of the steps minus the first half."""
    fresh = run["steps"]["fresh_reward"]
    half = len(fresh) // 2
    return mean(fresh[-half:]) - mean(fresh[:half])


def write(args: argparse.Namespace, runs: list[dict], lora_arm: str, reused: list[int]) -> None:
    arms = analyse(runs, args.steps)
    by = {(r["arm"], r["seed"]): r for r in runs}
    for arm in arms:
        arms[arm]["rise_per_seed"] = {s: rise(by[(arm, s)]) for s in arms[arm]["seeds"]}
        arms[arm]["rise_mean"] = mean(list(arms[arm]["rise_per_seed"].values()))
    if FULL_ARM in arms and lora_arm in arms:
        paired = [s for s in arms[lora_arm]["seeds"] if s in arms[FULL_ARM]["seeds"]]
        arms[lora_arm]["same_first_step"] = all(
            by[(lora_arm, s)]["steps"]["fresh_reward"][0] == by[(FULL_ARM, s)]["steps"]["fresh_reward"][0]
            for s in paired)
        arms[lora_arm]["rise_vs_full"] = (mean([arms[lora_arm]["rise_per_seed"][s] for s in paired])
                                          / max(mean([arms[FULL_ARM]["rise_per_seed"][s] for s in paired]), 1e-9))
    results = {"command": shlex.join([sys.executable, *sys.argv]), "steps": args.steps, "seeds": args.seeds,
               "full_runs_reused_from": FULL_RECORD if reused else None, "full_seeds_reused": reused,
               "load_average": os.getloadavg(), "arms": arms, "runs": runs}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS + ".json", "w") as f:
        json.dump(results, f, indent=1)
    text = table(arms, args.steps) if arms else "(no finished run)"
    rises = "\n".join(f"- {arm}: fresh reward rise (last half - first half) {a['rise_mean']:+.3f} per seed "
                      + ", ".join(f"{v:+.3f}" for v in a["rise_per_seed"].values())
                      + (f"; {a['rise_vs_full']:.0%} of full fine-tuning's, same step 1: {a['same_first_step']}"
                         if "rise_vs_full" in a else "") for arm, a in arms.items())
    with open(RESULTS + ".md", "w") as f:
        f.write(f"# LoRA vs full fine-tuning (SmolLM2-135M, {args.steps} steps)\n\n`{results['command']}`\n\n"
                f"{text}\n\n{rises}\n")
    print(text + "\n" + rises)


def partial(args: argparse.Namespace, lora_arm: str) -> None:
    """The steps the LoRA runs have logged so far (finished or not, no evaluation) against the full fine-tuning
    record's same first steps: the fresh-reward curves, their rise and the seconds per step."""
    recorded, out = recorded_full_runs(args.steps), {}
    for seed in args.seeds:
        run_dir = os.path.join(args.root, f"{lora_arm}_seed{seed}", "run")
        if seed not in recorded or not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
            continue
        lora = load_steps(run_dir)
        n = len(lora["step"])
        full = {k: v[:n] for k, v in recorded[seed]["steps"].items()}
        out[seed] = {"steps": n, **{f"{name}_{key}": s[key] for name, s in (("full", full), (lora_arm, lora))
                                    for key in ("fresh_reward", "reward")},
                     "full_rise": rise({"steps": full}), f"{lora_arm}_rise": rise({"steps": lora}),
                     "full_mean_step_s": mean(full["step_s"][1:]), f"{lora_arm}_mean_step_s": mean(lora["step_s"][1:]),
                     "same_first_step": full["fresh_reward"][0] == lora["fresh_reward"][0]}
        print(json.dumps({k: v for k, v in out[seed].items() if not isinstance(v, list)}))
    with open(RESULTS + "_partial.json", "w") as f:
        json.dump({"command": shlex.join([sys.executable, *sys.argv]), "complete": False,
                   "overrides": list(lora_overrides(args)), "full_runs_from": FULL_RECORD, "seeds": out,
                   "load_average": os.getloadavg()}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=2.0e-5, help="LoRA's optim.lr (the preset's is 2e-6)")
    parser.add_argument("--root", default=os.path.join(REPO, "runs", "bench_lora_learning"))
    parser.add_argument("--analyse-only", action="store_true", help="the table from the finished runs on disk")
    parser.add_argument("--partial", action="store_true",
                        help="the steps logged so far vs full fine-tuning's same steps (lora_learning_partial.json)")
    args = parser.parse_args(argv)
    lora_arm = f"lora_r{args.rank}"
    if args.partial:
        return partial(args, lora_arm)
    recorded = recorded_full_runs(args.steps)
    reused = [s for s in args.seeds if s in recorded]
    runs = [recorded[s] for s in reused]
    hf_dir = ckpt = ""
    if not args.analyse_only:
        os.makedirs(args.root, exist_ok=True)
        hf_dir, ckpt = prepare(args.root)
    for seed in args.seeds:
        for arm, overrides in ((FULL_ARM, None), (lora_arm, lora_overrides(args))):
            if arm == FULL_ARM and seed in reused:
                continue
            done = os.path.join(args.root, f"{arm}_seed{seed}", "run.json")
            if args.analyse_only:
                if os.path.isfile(done):
                    with open(done) as f:
                        runs.append(json.load(f))
                continue
            runs.append(run_one(arm, seed, args, hf_dir, ckpt, overrides))
            write(args, runs, lora_arm, reused)
    write(args, runs, lora_arm, reused)


if __name__ == "__main__":
    main()
