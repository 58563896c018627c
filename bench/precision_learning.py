"""Does bf16 learn as fp32 does, and does the cheaper pi_old source learn as the recompute does? SmolLM2-135M-Instruct,
ExGRPO on the shipped word problems (`smollm2_word_problems`), the same seeds in every arm:

    .venv/bin/python bench/precision_learning.py [--steps 20] [--seeds 1 2 3] [--arms fp32 bf16_recompute ...]
    .venv/bin/python bench/precision_learning.py --analyse-only      # the tables from the runs on disk

Arms (`ARMS`): fp32 (pi_old from the engine: exact there); bf16 with pi_old recomputed by a forward pass of the batch
(`algo.old_logprobs=recompute`); bf16 with pi_old from the update's own forward (`training_forward`, no extra pass),
with and without truncated IS against the engine's log-probs (`algo.fresh_is_cap=2`). Runs go seed by seed, every
arm per seed, so an interrupted bench leaves balanced arms; each run resumes from its newest checkpoint and a finished
one (`<root>/<arm>_seed<S>/run.json`) is not re-run. After training, each run's last checkpoint is exported to HF in
fp32 and evaluated greedily on the 48 validation problems with the fp32 megatron engine (the same evaluation for
every arm, so it compares what was learnt, not the evaluation's precision).

Writes bench/results/precision_learning.{json,md,png}: per arm the reward curves (mean over seeds and min..max) of
the fresh samples (the policy's own on new questions: what it learnt; the batch reward also holds the replayed
trajectories, chosen among questions the model already half-solves) and of the whole batch, the fresh reward of the
last half of the run per seed, its paired difference against fp32 per seed, the evaluation after training, seconds
per step (train phase, its pi_old part, generation), the rollout/trainer mismatch, and how far training moved the
model's weights (the exported weights against the initial ones in the arm's precision: the share of entries that
changed and the relative change of each tensor, averaged); the GEMM peaks measured at the start
(bench/machine_peaks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from machine_peaks import measure_peaks
from real_model_e2e import evaluate, load_steps, prepare, run

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "precision_learning")
BF16_TF = ("model.params_dtype=bf16", "algo.old_logprobs=training_forward")
ARMS: dict[str, tuple[str, ...]] = {
    "fp32": ("model.params_dtype=fp32",),
    "bf16_recompute": ("model.params_dtype=bf16", "algo.old_logprobs=recompute"),
    "bf16_training_forward_tis": (*BF16_TF, "algo.fresh_is_cap=2.0"),
    "bf16_training_forward": BF16_TF,
}


def run_one(arm: str, seed: int, args: argparse.Namespace, hf_dir: str, ckpt: str,
            overrides: tuple[str, ...] | None = None) -> dict:
    """Train (resumably), export in fp32, evaluate; cached in <root>/<arm>_seed<seed>/run.json. `overrides`: the
    arm's config overrides (default ARMS[arm])."""
    overrides = ARMS[arm] if overrides is None else overrides
    root = os.path.join(args.root, f"{arm}_seed{seed}")
    done = os.path.join(root, "run.json")
    if os.path.isfile(done):
        with open(done) as f:
            return json.load(f)
    os.makedirs(root, exist_ok=True)
    run_dir, log = os.path.join(root, "run"), os.path.join(root, "stages.log")
    run(["-m", "exgrpo_megatron.train", "--config-name", "smollm2_word_problems", f"seed={seed}",
         f"checkpoint.init_from={ckpt}", f"logging.run_dir={run_dir}", f"trainer.total_steps={args.steps}",
         f"checkpoint.save_every={args.save_every}", "checkpoint.resume=auto", *overrides], log)
    export = os.path.join(root, "hf_export")
    if not os.path.isfile(os.path.join(export, "config.json")):
        run(["tools/convert_megatron_to_hf.py", run_dir, export, "--dtype", "fp32"], log)
    result = {"arm": arm, "seed": seed, "overrides": list(overrides), "steps": load_steps(run_dir),
              "eval_after": evaluate(export, hf_dir, os.path.join(root, "eval"), "megatron", sys.executable, log),
              "weights": weight_change(export, hf_dir, "model.params_dtype=bf16" in overrides)}
    with open(done, "w") as f:
        json.dump(result, f, indent=1)
    return result


def weight_change(export: str, initial: str, bf16: bool) -> dict[str, float]:
    """How far training moved the model's weights: the share of entries of the exported (fp32) weights that differ
    from the initial ones (rounded to bf16 for a bf16 arm: the weights it started from) and the mean over tensors of
    |w - w0| / |w0|."""
    import torch

    from exgrpo_megatron.convert.hf_io import SafetensorsSource

    start, end = SafetensorsSource(initial), SafetensorsSource(export)
    changed = total = 0
    rel = []
    for name in end.names():
        w, w0 = end.get(name), start.get(name)
        w0 = w0.to(torch.bfloat16).float() if bf16 else w0.float()
        changed += int((w.float() != w0).sum())
        total += w.numel()
        rel.append(float((w.float() - w0).norm() / w0.norm().clamp_min(1e-30)))
    return {"changed_fraction": changed / max(total, 1), "mean_relative_change": mean(rel)}


def mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def analyse(runs: list[dict], steps: int) -> dict:
    """Per arm: the curve over seeds, the late reward per seed, the paired difference against fp32, the times."""
    half = steps // 2
    by_arm: dict[str, dict[int, dict]] = {}
    for r in runs:
        if len(r["steps"]["step"]) == steps:
            by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    out: dict = {}
    for arm, seeds in by_arm.items():
        curves = [seeds[s]["steps"]["fresh_reward"] for s in sorted(seeds)]
        batch = [seeds[s]["steps"]["reward"] for s in sorted(seeds)]
        late = {s: mean(seeds[s]["steps"]["fresh_reward"][half:]) for s in sorted(seeds)}
        timing = {k: mean([mean(seeds[s]["steps"][k][1:]) for s in seeds])  # step 1 holds the start-up
                  for k in ("step_s", "generate_s", "train_s", "old_logprobs_s")}
        out[arm] = {
            "seeds": sorted(seeds), "overrides": next(iter(seeds.values()))["overrides"],
            "fresh_reward_mean": [mean(list(c)) for c in zip(*curves, strict=True)],
            "fresh_reward_min": [min(c) for c in zip(*curves, strict=True)],
            "fresh_reward_max": [max(c) for c in zip(*curves, strict=True)],
            "batch_reward_mean": [mean(list(c)) for c in zip(*batch, strict=True)],
            "late_batch_reward_mean": mean([mean(c[half:]) for c in batch]),
            "late_reward_per_seed": late, "late_reward_mean": mean(list(late.values())),
            "eval_after_per_seed": {s: seeds[s]["eval_after"]["math_verify_accuracy"] for s in sorted(seeds)},
            "eval_after_mean": mean([seeds[s]["eval_after"]["math_verify_accuracy"] for s in seeds]),
            "weights_changed_fraction": mean([seeds[s]["weights"]["changed_fraction"] for s in seeds]),
            "weights_mean_relative_change": mean([seeds[s]["weights"]["mean_relative_change"] for s in seeds]),
            "mismatch_mean": mean([mean(seeds[s]["steps"]["logprob_ratio"]) for s in seeds]),
            "is_weight_mean": mean([mean(seeds[s]["steps"]["is_weight"]) for s in seeds]),
            "is_truncated_fraction": mean([mean(seeds[s]["steps"]["is_truncated"]) for s in seeds]),
            **{f"mean_{k}": v for k, v in timing.items()}}
    ref = out.get("fp32")
    for arm, a in out.items():
        if ref is None or arm == "fp32":
            continue
        paired = [a["late_reward_per_seed"][s] - ref["late_reward_per_seed"][s] for s in a["seeds"]
                  if s in ref["late_reward_per_seed"]]
        spread = list(ref["late_reward_per_seed"].values())
        a["late_reward_minus_fp32_per_seed"] = paired
        a["late_reward_minus_fp32_mean"] = mean(paired)
        a["late_reward_inside_fp32_seed_spread"] = min(spread) <= a["late_reward_mean"] <= max(spread)
        a["eval_minus_fp32_mean"] = a["eval_after_mean"] - ref["eval_after_mean"]
        a["step_speedup_vs_fp32"] = ref["mean_step_s"] / a["mean_step_s"]
        a["train_speedup_vs_fp32"] = ref["mean_train_s"] / a["mean_train_s"]
    return out


def table(arms: dict, steps: int) -> str:
    lines = [f"| arm | fresh reward, steps {steps // 2 + 1}-{steps} (per seed) | minus fp32 | batch reward | greedy "
             "eval after | weights changed (relative change) | s / step | train s (pi_old s) | generate s | mismatch | "
             "step speed-up vs fp32 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        per_seed = ", ".join(f"{v:.3f}" for v in a["late_reward_per_seed"].values())
        diff = "" if arm == "fp32" else f"{a['late_reward_minus_fp32_mean']:+.3f}"
        speed = "" if arm == "fp32" else f"{a['step_speedup_vs_fp32']:.2f}x"
        lines.append(f"| {arm} | {a['late_reward_mean']:.3f} ({per_seed}) | {diff} | "
                     f"{a['late_batch_reward_mean']:.3f} | {a['eval_after_mean']:.3f} | "
                     f"{a['weights_changed_fraction']:.1%} ({a['weights_mean_relative_change']:.1e}) | "
                     f"{a['mean_step_s']:.1f} | {a['mean_train_s']:.1f} ({a['mean_old_logprobs_s']:.1f}) | "
                     f"{a['mean_generate_s']:.1f} | {a['mismatch_mean']:.4f} | {speed} |")
    return "\n".join(lines)


def plot(arms: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for arm, a in arms.items():
        x = list(range(1, len(a["fresh_reward_mean"]) + 1))
        (line,) = ax.plot(x, a["fresh_reward_mean"], label=f"{arm} (mean of seeds {a['seeds']})")
        ax.fill_between(x, a["fresh_reward_min"], a["fresh_reward_max"], color=line.get_color(), alpha=0.15)
        bx.plot(x, a["batch_reward_mean"], color=line.get_color(), label=arm)
    ax.set_title("fresh samples' reward (T = 0.6; band: min..max over seeds)")
    bx.set_title("batch reward, replayed trajectories included (mean over seeds)")
    for axis in (ax, bx):
        axis.set_xlabel("step")
        axis.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, ExGRPO on word problems: precision and pi_old source")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def write(args: argparse.Namespace, runs: list[dict], peaks: dict | None) -> None:
    arms = analyse(runs, args.steps)
    results = {"command": shlex.join([sys.executable, *sys.argv]), "steps": args.steps, "seeds": args.seeds,
               "machine_peaks": peaks, "load_average": os.getloadavg(), "arms": arms, "runs": runs}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS + ".json", "w") as f:
        json.dump(results, f, indent=1)
    text = table(arms, args.steps) if arms else "(no finished run)"
    with open(RESULTS + ".md", "w") as f:
        f.write(f"# bf16 vs fp32 learning and the pi_old source (SmolLM2-135M, {args.steps} steps)\n\n"
                f"`{results['command']}`\n\n{text}\n")
    if arms:
        plot(arms, RESULTS + ".png")
    print(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--arms", nargs="+", default=list(ARMS)[:3], choices=list(ARMS))
    parser.add_argument("--root", default=os.path.join(REPO, "runs", "bench_precision_learning"))
    parser.add_argument("--analyse-only", action="store_true", help="the tables from the finished runs on disk")
    args = parser.parse_args(argv)
    plan = [(arm, seed) for seed in args.seeds for arm in args.arms]
    if args.analyse_only:
        runs = []
        for arm, seed in plan:
            done = os.path.join(args.root, f"{arm}_seed{seed}", "run.json")
            if os.path.isfile(done):
                with open(done) as f:
                    runs.append(json.load(f))
        peaks = None  # the peaks the running bench measured, kept from its results
        if os.path.isfile(RESULTS + ".json"):
            with open(RESULTS + ".json") as f:
                peaks = json.load(f).get("machine_peaks")
        return write(args, runs, peaks)
    os.makedirs(args.root, exist_ok=True)
    hf_dir, ckpt = prepare(args.root)
    peaks = {"generate_1_thread": measure_peaks(1), "train_2_threads": measure_peaks(2)}
    runs = []
    for arm, seed in plan:
        runs.append(run_one(arm, seed, args, hf_dir, ckpt))
        write(args, runs, peaks)


if __name__ == "__main__":
    main()
