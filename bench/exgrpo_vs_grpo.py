"""ExGRPO vs on-policy GRPO on the CPU demo task: same compute, several seeds, one process per run.

Both arms run the `demo_cpu` preset unchanged (same steps, batch B, rollouts K, learning rate, warm start); the
only difference is the experience pool: the GRPO arm adds ``trainer.experience=false`` (the one switch for the
on-policy baseline; ``conf/trainer/grpo.yaml`` sets just that). Seed s gives both arms the same data, the same
cached supervised warm start (built once per seed under ``<root>/sft_cache``; the GRPO run of a seed waits for
its ExGRPO run) and the same validation set. The held-out set is enlarged to ``--val-examples`` questions for
both arms (the demo's 64 is too noisy to rank two methods).

Reported per arm (mean +- sample std over seeds, ddof=1):
* reward curves: ``reward/mean`` (what the demo prints) and ``reward/fresh_mean`` per step, mean +- std band;
  ExGRPO's ``reward/mean`` includes the replayed trajectory of each experience group (correct by construction)
  and half its batch is pool questions, so its training reward is NOT comparable across arms;
* final held-out accuracy: the trainer's ``val/avg@k`` at the last step (temperature ``rollout.val_temperature``),
  the comparable number;
* steps to threshold: the first step s where the 5-step trailing moving average
  MA_s = (1/5) * sum_{i=s-4..s} r_i of ``reward/mean`` (and of ``reward/fresh_mean``) is >= ``--threshold``;
  "never" when it is not reached (counted as missing, not averaged);
* the demo criterion: mean ``reward/mean`` over the last 10 steps minus the first 10.

Run: ``.venv/bin/python bench/exgrpo_vs_grpo.py [--seeds 1234 1235 1236] [--jobs 2] [--arms grpo]``
(writes bench/results/exgrpo_vs_grpo.json and .png; runs under runs/bench_exgrpo_vs_grpo/; ``--arms`` re-runs
only some arms and analyses the existing run dirs of the others).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_JSON = os.path.join(HERE, "results", "exgrpo_vs_grpo.json")
RESULTS_PNG = os.path.join(HERE, "results", "exgrpo_vs_grpo.png")
ARMS: dict[str, list[str]] = {"exgrpo": [], "grpo": ["trainer.experience=false"]}
WINDOW = 5


@dataclass
class Job:
    arm: str
    seed: int
    run_dir: str
    argv: list[str]
    waits_for: str | None = None  # the run dir whose completion this job needs (shared warm-start cache)
    wall_s: float | None = None
    rc: int | None = None
    log: str = field(default="")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_jobs(args: argparse.Namespace) -> list[Job]:
    """Arm-major order: every ExGRPO seed first, so each GRPO run finds its seed's warm start cached."""
    jobs = []
    for arm, extra in ARMS.items():
        for seed in args.seeds:
            run_dir = os.path.join(args.root, f"{arm}_seed{seed}")
            argv = [sys.executable, "-m", "exgrpo_megatron.train", "--config-name", args.config_name,
                    f"seed={seed}", f"logging.run_dir={run_dir}", "logging.tensorboard=false",
                    "logging.progress_bar=false", "checkpoint.resume=none",
                    f"trainer.sft_cache_dir={os.path.join(args.root, 'sft_cache')}",
                    f"data.num_val_examples={args.val_examples}", *args.override, *extra]
            waits = os.path.join(args.root, f"exgrpo_seed{seed}") if arm != "exgrpo" else None
            jobs.append(Job(arm, seed, run_dir, argv, waits))
    return jobs


def run_jobs(jobs: list[Job], parallel: int, threads: int) -> None:
    """Run every job as its own process, at most `parallel` at a time, respecting `waits_for`."""
    pending, running, done = list(jobs), {}, set()
    while pending or running:
        for job in list(pending):
            if len(running) >= parallel:
                break
            if job.waits_for is not None and job.waits_for not in done and any(
                    j.run_dir == job.waits_for for j in jobs):
                continue
            shutil.rmtree(job.run_dir, ignore_errors=True)
            os.makedirs(job.run_dir, exist_ok=True)
            job.log = os.path.join(job.run_dir, "train.log")
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MASTER_PORT=str(free_port()), HF_HUB_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false")
            for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
                env.pop(var, None)
            print(f"[bench] start {job.arm} seed={job.seed}: {shlex.join(job.argv[1:])}", file=sys.stderr)
            with open(job.log, "w") as log:
                proc = subprocess.Popen(job.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            running[job.run_dir] = (job, proc, time.perf_counter())
            pending.remove(job)
        time.sleep(1.0)
        for key, (job, proc, t0) in list(running.items()):
            if proc.poll() is not None:
                job.rc, job.wall_s = proc.returncode, time.perf_counter() - t0
                print(f"[bench] done {job.arm} seed={job.seed}: rc={job.rc} {job.wall_s:.0f}s", file=sys.stderr)
                done.add(key)
                del running[key]


# ----------------------------------------------------------------------------------------- analysis
def load_run(run_dir: str) -> dict:
    from exgrpo_megatron.logging.metrics import read_metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    records = sorted((r for r in read_metrics(path) if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    val_key = next((k for r in records for k in r if k.startswith("val/")), None)
    val = [(r["step"], float(r[val_key])) for r in records if val_key and r.get(val_key) is not None]
    return {
        "steps": [r["step"] for r in records],
        "reward": [float(r["reward/mean"]) for r in records],
        "fresh": [float(r["reward/fresh_mean"]) for r in records],
        "val": val, "val_key": val_key,
        "time_step": [float(r["time/step"]) for r in records],
        "replayed": sum(float(r.get("experience/n_replayed", 0.0)) for r in records),
        "mixed_from": next((r["step"] for r in records if r.get("phase") == "mixed"), None),
        "pool_buckets_last": {k.split("_")[-1]: int(v) for k, v in (records[-1] if records else {}).items()
                              if k.startswith("experience/bucket_")},
    }


def trailing_mean(values: list[float], window: int) -> list[float]:
    """MA_s = mean of values[s-window+1 .. s] (shorter at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def steps_to_threshold(steps: list[int], values: list[float], threshold: float, window: int = WINDOW) -> int | None:
    """First step whose `window`-step trailing moving average is >= threshold (only full windows count)."""
    ma = trailing_mean(values, window)
    return next((s for i, (s, m) in enumerate(zip(steps, ma, strict=True)) if i >= window - 1 and m >= threshold),
                None)


def mean_std(values: list[float]) -> dict:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


def summarize_arm(runs: dict[int, dict], threshold: float) -> dict:
    per_seed = {}
    for seed, run in runs.items():
        r = run["reward"]
        per_seed[seed] = {
            "final_val_acc": run["val"][-1][1] if run["val"] else None,
            "final_val_step": run["val"][-1][0] if run["val"] else None,
            "val_curve": run["val"],
            "reward_first10": statistics.fmean(r[:10]), "reward_last10": statistics.fmean(r[-10:]),
            "fresh_first10": statistics.fmean(run["fresh"][:10]), "fresh_last10": statistics.fmean(run["fresh"][-10:]),
            "steps_to_threshold_reward": steps_to_threshold(run["steps"], r, threshold),
            "steps_to_threshold_fresh": steps_to_threshold(run["steps"], run["fresh"], threshold),
            "median_time_per_step_s": statistics.median(run["time_step"]),
            "replayed_questions": run["replayed"], "mixed_from_step": run["mixed_from"],
            "pool_buckets_last": run["pool_buckets_last"], "steps": len(run["steps"]),
        }
    def col(key: str) -> list:
        return [p[key] for p in per_seed.values()]
    delta = [p["reward_last10"] - p["reward_first10"] for p in per_seed.values()]
    reached = [s for s in col("steps_to_threshold_reward") if s is not None]
    reached_fresh = [s for s in col("steps_to_threshold_fresh") if s is not None]
    return {
        "per_seed": per_seed,
        "final_val_acc": mean_std(col("final_val_acc")),
        "reward_first10": mean_std(col("reward_first10")), "reward_last10": mean_std(col("reward_last10")),
        "reward_delta": mean_std(delta),
        "fresh_first10": mean_std(col("fresh_first10")), "fresh_last10": mean_std(col("fresh_last10")),
        "steps_to_threshold_reward": {**mean_std(reached), "reached": f"{len(reached)}/{len(per_seed)}"},
        "steps_to_threshold_fresh": {**mean_std(reached_fresh), "reached": f"{len(reached_fresh)}/{len(per_seed)}"},
    }


def band(curves: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per-step mean and mean -+ sample std over the curves (truncated to the shortest)."""
    n = min(len(c) for c in curves)
    mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
    std = [statistics.stdev(c[i] for c in curves) if len(curves) > 1 else 0.0 for i in range(n)]
    return mean, [m - s for m, s in zip(mean, std, strict=True)], [m + s for m, s in zip(mean, std, strict=True)]


def plot(all_runs: dict[str, dict[int, dict]], threshold: float, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("reward", "reward/mean (5-step moving avg)"), ("fresh", "reward/fresh_mean (5-step moving avg)"),
              ("val", "held-out accuracy"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for arm, runs in all_runs.items():
            if key == "val":
                curves = [[v for _, v in run["val"]] for run in runs.values()]
                x = [s for s, _ in next(iter(runs.values()))["val"]]
            else:
                curves = [trailing_mean(run[key], WINDOW) for run in runs.values()]
                x = next(iter(runs.values()))["steps"]
            if not curves or not x:
                continue
            mean, lo, hi = band(curves)
            x = x[:len(mean)]
            ax.plot(x, mean, label=f"{arm} (n={len(curves)})", marker="o" if key == "val" else None)
            ax.fill_between(x, lo, hi, alpha=0.25)
        if key != "val":
            ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    fig.suptitle("ExGRPO vs on-policy GRPO, demo_cpu task (mean +- std over seeds)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def fmt(ms: dict, digits: int = 3) -> str:
    return "n/a" if ms.get("mean") is None else f"{ms['mean']:.{digits}f} +- {ms['std']:.{digits}f}"


def print_table(summary: dict, threshold: float) -> None:
    rows = [("final held-out acc", "final_val_acc", 3), ("reward/mean first 10", "reward_first10", 3),
            ("reward/mean last 10", "reward_last10", 3), ("reward/mean last-first", "reward_delta", 3),
            ("fresh reward first 10", "fresh_first10", 3), ("fresh reward last 10", "fresh_last10", 3),
            (f"steps to MA5 reward>={threshold}", "steps_to_threshold_reward", 1),
            (f"steps to MA5 fresh>={threshold}", "steps_to_threshold_fresh", 1)]
    arms = list(summary)
    print(f"{'metric':34s}" + "".join(f"{a:>24s}" for a in arms))
    for label, key, digits in rows:
        cells = []
        for a in arms:
            cell = fmt(summary[a][key], digits)
            if "reached" in summary[a][key]:
                cell += f" ({summary[a][key]['reached']})"
            cells.append(cell)
        print(f"{label:34s}" + "".join(f"{c:>24s}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    p.add_argument("--config-name", default="demo_cpu")
    p.add_argument("--root", default=os.path.join(REPO, "runs", "bench_exgrpo_vs_grpo"))
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each is one process)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--threshold", type=float, default=0.4, help="reward level for steps-to-threshold")
    p.add_argument("--val-examples", type=int, default=256, help="held-out questions (both arms)")
    p.add_argument("--override", nargs="*", default=[], help="extra hydra overrides for both arms")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                   help="arms to (re)run; the analysis reads every arm's existing run dirs")
    p.add_argument("--analyse-only", action="store_true", help="skip training; read the existing run dirs")
    p.add_argument("--out-json", default=RESULTS_JSON)
    p.add_argument("--out-png", default=RESULTS_PNG)
    args = p.parse_args(argv)
    args.root = os.path.abspath(args.root)
    sys.path.insert(0, REPO)

    jobs = build_jobs(args)
    to_run = [j for j in jobs if j.arm in args.arms]  # a job waits only for runs that are in this list
    load_before, t0 = os.getloadavg(), time.perf_counter()
    if not args.analyse_only:
        run_jobs(to_run, args.jobs, args.threads)
    total_s, load_after = time.perf_counter() - t0, os.getloadavg()
    failed = [j for j in jobs if j.rc not in (0, None)]
    all_runs: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    for job in jobs:
        if job.rc in (0, None) and os.path.isfile(os.path.join(job.run_dir, "metrics.jsonl")):
            all_runs[job.arm][job.seed] = load_run(job.run_dir)
    summary = {arm: summarize_arm(runs, args.threshold) for arm, runs in all_runs.items() if runs}
    print_table(summary, args.threshold)
    plot(all_runs, args.threshold, args.out_png)
    result = {
        "command": shlex.join([".venv/bin/python", "bench/exgrpo_vs_grpo.py", *(argv if argv is not None
                                                                              else sys.argv[1:])]),
        "config_name": args.config_name, "seeds": args.seeds, "arms": {a: ARMS[a] for a in ARMS},
        "common_overrides": [f"data.num_val_examples={args.val_examples}", "checkpoint.resume=none", *args.override],
        "val_metric": next((r["val_key"] for runs in all_runs.values() for r in runs.values()), None),
        "threshold": args.threshold, "moving_average_window": WINDOW, "std": "sample std over seeds (ddof=1)",
        "runtime_s": None if args.analyse_only else round(total_s, 1),
        "parallel_runs": args.jobs, "omp_num_threads": args.threads,
        "run_wall_s": {f"{j.arm}_seed{j.seed}": None if j.wall_s is None else round(j.wall_s, 1) for j in jobs},
        "loadavg_before": load_before, "loadavg_after": load_after, "cpu_count": os.cpu_count(),
        "failed_runs": [f"{j.arm}_seed{j.seed} rc={j.rc} (log {j.log})" for j in failed],
        "summary": summary,
        "png": os.path.relpath(args.out_png, REPO),
    }
    os.makedirs(os.path.dirname(args.out_json), exist_ok=True)
    with open(args.out_json, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out_json} and {args.out_png}" + (f"; FAILED: {result['failed_runs']}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
