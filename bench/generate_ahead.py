"""Colocated (generate, then train) against generating one step ahead (`rollout.max_staleness=1`), side by side.

    nohup .venv/bin/python bench/generate_ahead.py > runs/generate_ahead.log 2>&1 &          # demo x 3 seeds + SmolLM2
    .venv/bin/python bench/generate_ahead.py --demo-steps 20 --seeds 1 --real-steps 0         # a quick look

Both arms get the same two cores. Colocated: the trainer process on cores {0, 1} (2 threads, generation and
training in turn). Ahead: the trainer on core 0 (1 thread) and the generator process on core 1
(`rollout.generator.cpu_cores=[1]`, 1 thread), with the truncated-IS cap at 2. Shapes: the demo (`demo_cpu`,
--demo-steps, --seeds: learning and step time) and the real model (SmolLM2-135M-Instruct, `smollm2_word_problems`
from the converted HF weights, --real-steps, seed 1: step time). The machine's limit, from the colocated arm's own
phase times in the same run: an overlapped step cannot beat max(generate, train) of the colocated step on the same
cores, nor the colocated step itself when both phases scale linearly with cores (each then gets half).

Writes bench/results/generate_ahead.json (per arm and shape: step time, the phases, the wait for the generator,
staleness, IS weights, mismatch, reward curve and final validation accuracy; the load average) and prints a table.
A run's directory is kept (runs/bench_generate_ahead/...), and a finished run is not re-run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from real_model_e2e import prepare

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_JSON = os.path.join(HERE, "results", "generate_ahead.json")
ARMS = {
    "colocated": (["taskset", "-c", "0,1"], ["trainer.train_threads=2"]),
    "ahead": (["taskset", "-c", "0"], ["trainer.train_threads=1", "rollout.max_staleness=1", "algo.fresh_is_cap=2.0",
                                       "rollout.generator.cpu_cores=[1]", "rollout.generator.threads=1"]),
}
KEYS = {"step_s": "time/step", "generate_s": "time/generate", "train_s": "time/train", "reward": "reward/mean",
        "staleness": "rollout/staleness", "is_weight": "rollout/is_weight_mean",
        "is_truncated": "rollout/is_truncated_fraction", "mismatch": "mismatch/token_mult_prob_error",
        "generator_s": "time/generator_generate"}


def train(arm: str, preset: str, run_dir: str, overrides: list[str]) -> list[dict]:
    """One run (resumed if interrupted, skipped if finished); its per-step metrics."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    done = os.path.join(run_dir, "bench_done")
    if not os.path.isfile(done):
        pin, arm_overrides = ARMS[arm]
        os.makedirs(run_dir, exist_ok=True)
        env_threads = "2" if arm == "colocated" else "1"
        cmd = [*pin, sys.executable, "-m", "exgrpo_megatron.train", "--config-name", preset,
               f"logging.run_dir={run_dir}", "logging.progress_bar=false", "checkpoint.resume=auto",
               *arm_overrides, *overrides]
        log = os.path.join(run_dir, "bench.log")
        print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
        with open(log, "a") as out:
            rc = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, OMP_NUM_THREADS=env_threads, HF_HUB_OFFLINE="1",
                                          TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO))
        if rc != 0:
            raise SystemExit(f"[bench] {arm} failed (rc={rc}); see {log}")
        open(done, "w").close()
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def summarise(rows: list[dict]) -> dict:
    """Means over the steps after the first (start-up and the first generation are in step 1)."""
    steady = rows[1:] or rows
    out = {k: statistics.fmean(float(r.get(key, 0.0)) for r in steady) for k, key in KEYS.items()}
    out["rewards"] = [float(r["reward/mean"]) for r in rows]
    vals = [float(v) for r in rows for k, v in r.items() if k.startswith("val/avg@")]
    out["final_val"] = vals[-1] if vals else None
    out["steps"] = len(rows)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=os.path.join(REPO, "runs", "bench_generate_ahead"))
    p.add_argument("--demo-steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--real-steps", type=int, default=6, help="SmolLM2 steps per arm (0: skip the real model)")
    p.add_argument("--out", default=RESULTS_JSON)
    args = p.parse_args(argv)
    results: dict = {"command": " ".join(["bench/generate_ahead.py", *(argv or sys.argv[1:])]),
                     "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg(), "demo": {}, "smollm2": {}}
    started = time.time()
    for seed in args.seeds:
        for arm in ARMS:
            rows = train(arm, "demo_cpu", os.path.join(args.root, f"demo_{arm}_seed{seed}"),
                         [f"seed={seed}", f"trainer.total_steps={args.demo_steps}",
                          f"trainer.val_every={args.demo_steps}", f"checkpoint.save_every={args.demo_steps}"])
            results["demo"].setdefault(arm, []).append({"seed": seed, **summarise(rows)})
    if args.real_steps > 0:
        _, ckpt = prepare(args.root)
        for arm in ARMS:
            rows = train(arm, "smollm2_word_problems", os.path.join(args.root, f"smollm2_{arm}"),
                         [f"checkpoint.init_from={ckpt}", f"trainer.total_steps={args.real_steps}",
                          f"checkpoint.save_every={args.real_steps}", "trainer.val_every=0"])
            results["smollm2"][arm] = summarise(rows)
    results["loadavg_end"] = os.getloadavg()
    results["wall_s"] = time.time() - started
    results["table"] = table(results)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(results["table"])
    return 0


def table(results: dict) -> str:
    lines = ["| shape | arm | step s | generate s (ahead: wait) | train s | limit max(gen, train) s | "
             "step / colocated | staleness | IS weight | IS truncated | final val | last reward |", "|" + "---|" * 12]
    for shape in ("demo", "smollm2"):
        arms = results[shape]
        if not arms:
            continue
        per = {arm: (rows if isinstance(rows, list) else [rows]) for arm, rows in arms.items()}
        mean = {arm: {k: statistics.fmean(r[k] for r in rs) for k in ("step_s", "generate_s", "train_s", "staleness",
                                                                         "is_weight", "is_truncated")}
                for arm, rs in per.items()}
        colocated = mean.get("colocated", {})
        limit = max(colocated.get("generate_s", 0.0), colocated.get("train_s", 0.0))
        for arm, m in mean.items():
            vals = [r["final_val"] for r in per[arm] if r["final_val"] is not None]
            val = f"{statistics.fmean(vals):.3f} (n={len(vals)})" if vals else "-"
            last = statistics.fmean(r["rewards"][-1] for r in per[arm])
            ratio = m["step_s"] / colocated["step_s"] if colocated else float("nan")
            lines.append(f"| {shape} | {arm} | {m['step_s']:.2f} | {m['generate_s']:.2f} | {m['train_s']:.2f} | "
                         f"{limit:.2f} | {ratio:.2f} | {m['staleness']:.2f} | {m['is_weight']:.3f} | "
                         f"{m['is_truncated']:.4f} | {val} | {last:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
