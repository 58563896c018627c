"""Does the MoE demo learn? conf/demo_moe_cpu.yaml (a Qwen3-MoE-shaped demo policy, 4 experts, EP=2 over two CPU
ranks) trained end to end with torchrun, and what it learned: reward/mean over the first and last 10 steps, the
validation accuracy (avg@8, T=0.6) at its first and last evaluation, the experts' load and the routing disagreement.

    .venv/bin/python bench/moe_demo.py [--steps 120] [--override key=value ...]

Writes bench/results/moe_demo.json (resumes the run if its directory exists: checkpoint.resume=auto).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


def summarise(records: list[dict], window: int = 10) -> dict:
    """Learning over a run's metrics records: first vs last `window` steps' reward, first vs last validation."""
    steps = [r for r in records if isinstance(r.get("step"), int)]
    first, last = steps[:window], steps[-window:]
    vals = [(r["step"], v) for r in steps for k, v in r.items() if k.startswith("val/") and isinstance(v, float)]
    load = [v for k, v in steps[-1].items() if k.startswith("moe/expert_load/")]
    return {
        "steps": len(steps),
        "reward_first": statistics.mean(r["reward/mean"] for r in first),
        "reward_last": statistics.mean(r["reward/mean"] for r in last),
        "reward_gain": (statistics.mean(r["reward/mean"] for r in last)
                        - statistics.mean(r["reward/mean"] for r in first)),
        "val_first": vals[0] if vals else None,
        "val_last": vals[-1] if vals else None,
        "expert_load_last": load,
        "load_max_over_mean_last": steps[-1].get("moe/load_max_over_mean"),
        "routing_disagreement_mean": statistics.mean(r.get("moe/routing_disagreement", 0.0) for r in steps),
        "seconds_per_step_median": statistics.median(r["time/step"] for r in steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--run-dir", default=os.path.join(REPO, "runs", "bench_moe_demo"))
    p.add_argument("--override", nargs="*", default=[])
    p.add_argument("--out", default=os.path.join(HERE, "results", "moe_demo.json"))
    args = p.parse_args(argv)
    from exgrpo_megatron.distributed.launch_env import free_local_port
    from exgrpo_megatron.logging.metrics import read_metrics

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(x for x in (REPO, os.environ.get("PYTHONPATH")) if x))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_local_port()), "-m", "exgrpo_megatron.train", "--config-name", "demo_moe_cpu",
           f"logging.run_dir={args.run_dir}",
           f"trainer.total_steps={args.steps}", "checkpoint.resume=auto", "logging.progress_bar=false",
           *args.override]
    start = time.perf_counter()
    rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    if rc != 0:
        print(f"[moe_demo] the run failed (exit {rc}): {' '.join(cmd)}", file=sys.stderr)
        return rc
    summary = summarise(read_metrics(os.path.join(args.run_dir, "metrics.jsonl")))
    out = {"command": " ".join(["bench/moe_demo.py", *(argv if argv is not None else sys.argv[1:])]),
           "preset": "demo_moe_cpu", "ranks": 2, "wall_seconds_this_launch": time.perf_counter() - start,
           "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), **summary}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"{'steps':>6} {'reward first10':>15} {'reward last10':>14} {'gain':>7} {'val first':>14} {'val last':>14}")
    print(f"{out['steps']:>6} {out['reward_first']:>15.3f} {out['reward_last']:>14.3f} {out['reward_gain']:>+7.3f} "
          f"{str(out['val_first']):>14} {str(out['val_last']):>14}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
