"""One RL step of the CPU demo, today's path vs the default, per phase.

Arms at the demo shape (``conf/demo_cpu.yaml``: B=64 prompts x K=8, 2 updates per step), same seed, run in
fresh processes and interleaved (round r runs the arms in order, round r+1 in reverse) so load on
the shared machine hits both alike:
* ``default``: the config as it is (every switch at its configured default);
* ``default_1_thread``: the default with ``trainer.train_threads=1`` (diagnostic: the threads' share alone);
* ``default_bf16``: the default with ``model.params_dtype=bf16`` (auto gives the demo fp32: its hidden size 128 is
  below machine/cpu_precision.py's threshold; this arm is the measurement behind it);
* ``today``: every switch of `SWITCHES` at its old value: old log-probs recomputed by a second forward pass,
  1 thread, no sequence packing, no fused output layer, megatron's unfused core attention, torch's RMSNorm and
  megatron's RoPE.
A switch whose key the config does not have (its branch not merged yet) is left out and listed under
"absent_switches"; adding a switch is one line of `SWITCHES`. Both arms replay from step 2
(``experience.delayed_start_pass_rate=0``) so the selection pass and replayed rows are in every measured step.

Per step (from the trainer's metrics.jsonl): time/generate (incl. batch composition and the selection pass),
time/reward (grading not overlapped with generation), time/old_logprobs, time/refit, the updates
(time/train - old log-probs - refit) and the train phase (time/train = old log-probs + updates + refit);
counted by a step observer of every pass through the policy: sequences through the policy per rollout sample
("forward passes per sample": selection + old log-probs + updates, a fwd+bwd counts once) and real vs padded
tokens (a row's real tokens = last response target + 2, so packed rows count as real). Step 1 (no replay yet,
allocator warm-up) is left out of the means. Reward and the mismatch metric are reported to check that both arms
learn the same (same seed: rewards within noise, mismatch ~ 1).

Run: ``.venv/bin/python bench/demo_step.py [--steps 6] [--rounds 2]`` -> bench/results/demo_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_JSON = os.path.join(HERE, "results", "demo_step.json")

# (config key, today's value): the default arm keeps the configured default of each key.
SWITCHES: list[tuple[str, object]] = [
    ("algo.old_logprobs", "recompute"),
    ("trainer.train_threads", 1),
    ("trainer.sequence_packing", False),
    ("trainer.fused_output_logprobs", False),
    ("model.core_attention", "megatron"),
    ("model.fused_norm_rope", False),
    ("trainer.micro_batch_max_tokens", 8192),  # the demo preset's budget before the fast step (now 2048)
]
COMMON = ["experience.delayed_start_pass_rate=0", "trainer.val_every=0", "checkpoint.save_every=100000",
          "logging.progress_bar=false", "logging.tensorboard=false"]
DEFAULT_ARMS = ["today", "default", "default_1_thread", "default_bf16"]
# (numerator arm, denominator arm) of the reported per-phase time ratios, where both ran
RATIOS = (("today", "default"), ("today", "default_1_thread"), ("default_bf16", "default"))
PHASES = ("generate", "reward", "old_logprobs", "updates", "refit", "train_phase", "step")


def _fmt(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def present_switches() -> tuple[list[tuple[str, object]], list[str]]:
    from omegaconf import OmegaConf

    from exgrpo_megatron.config.loader import compose

    cfg = compose("demo_cpu", [])
    present, absent = [], []
    for key, today in SWITCHES:
        (present if OmegaConf.select(cfg, key, default="__absent__") != "__absent__" else absent).append((key, today))
    return present, [k for k, _ in absent]


# ------------------------------------------------------------------------------------------------ worker
def _pass_counter(per_step: list[dict]):
    """A step observer counting, per step, the sequences and token slots of every pass through the policy."""
    import torch

    from exgrpo_megatron.training.step_observer import StepObserver

    class CountPasses(StepObserver):
        def __init__(self) -> None:
            self.counts: dict = {}

        def step_started(self, step) -> None:
            self.counts.clear()

        def policy_pass(self, step, site, micro_batches, forward_only) -> None:
            kind = "forward_only" if forward_only else "train"
            for mb in micro_batches:
                mask = mb.loss_mask.bool()
                idx = torch.arange(mask.shape[1]).expand_as(mask)
                real = (torch.where(mask, idx, torch.full_like(idx, -2)).max(dim=1).values + 2).clamp(min=0)
                c = self.counts.setdefault(kind, {"sequences": 0, "real_tokens": 0, "padded_tokens": 0})
                c["sequences"] += len(mb.rows)
                c["real_tokens"] += int(real.sum())
                c["padded_tokens"] += int(mb.tokens.numel())

        def step_finished(self, step, metrics) -> None:
            per_step.append({k: dict(v) for k, v in self.counts.items()})

    return CountPasses()


def worker(overrides: list[str], out_path: str) -> None:
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.logging import read_metrics
    from exgrpo_megatron.training.trainer import run_training

    cfg = load_config("demo_cpu", overrides)
    per_step: list[dict] = []
    assert run_training(cfg, observers=[_pass_counter(per_step)]) == 0
    metrics = read_metrics(os.path.join(cfg.logging.run_dir, "metrics.jsonl"))
    samples = cfg.trainer.train_batch_size * cfg.rollout.n
    with open(out_path, "w") as f:
        json.dump({"metrics": metrics, "passes": per_step, "samples_per_step": samples}, f)


# ------------------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_record(m: dict, passes: dict, samples: int) -> dict:
    old, refit, train = m["time/old_logprobs"], m["time/refit"], m["time/train"]
    seqs = sum(p["sequences"] for p in passes.values())
    upd = passes.get("train", {"real_tokens": 0, "padded_tokens": 0})
    allp = {k: sum(p[k] for p in passes.values()) for k in ("real_tokens", "padded_tokens")}
    return {
        "step": m["step"], "generate": m["time/generate"], "reward": m["time/reward"], "old_logprobs": old,
        "updates": train - old - refit, "refit": refit, "train_phase": train, "step_time": m["time/step"],
        "forward_passes_per_sample": seqs / samples,
        "update_real_tokens": upd["real_tokens"], "update_padded_tokens": upd["padded_tokens"],
        "all_real_tokens": allp["real_tokens"], "all_padded_tokens": allp["padded_tokens"],
        "reward_mean": m["reward/mean"], "mismatch": m["mismatch/token_mult_prob_error"],
        "n_replayed": m["experience/n_replayed"], "old_logprob_forward_rows": m.get("old_logprobs/forward_rows"),
    }


def summarise(records: list[dict]) -> dict:
    measured = [r for r in records if r["step"] > 1]

    def mean(k: str) -> float:
        return statistics.fmean(r[k] for r in measured)
    out = {p: mean("step_time" if p == "step" else p) for p in PHASES}
    out.update({k: mean(k) for k in ("forward_passes_per_sample", "reward_mean", "mismatch", "n_replayed")})
    for prefix in ("update", "all"):
        real, padded = mean(f"{prefix}_real_tokens"), mean(f"{prefix}_padded_tokens")
        out[f"{prefix}_real_tokens"], out[f"{prefix}_padded_tokens"] = real, padded
        out[f"{prefix}_padding_share"] = 1 - real / padded if padded else 0.0
    return out


def round_speedups(records: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """today / default of each round's own runs (adjacent in time, so a slow spell of the shared box hits both), per
    target phase, and their median over the rounds: robust to a spike in one run, which the ratio of the
    all-round means is not."""
    per_round = {p: [summarise(t)[p] / summarise(d)[p] for t, d in zip(records["today"], records["default"],
                                                                          strict=True)]
                 for p in ("train_phase", "step")}
    return {"per_round": per_round, "median": {p: statistics.median(v) for p, v in per_round.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--root", default=os.path.join(REPO, "runs", "bench_demo_step"))
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=DEFAULT_ARMS,
                    help="arms to run (a subset other than the default writes demo_step_<arms>.json)")
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, REPO)  # this tree's package, not the shared editable install
    if args.worker is not None:
        worker(args.worker, args.out)
        return
    present, absent = present_switches()
    all_arms = {"today": [f"{k}={_fmt(v)}" for k, v in present], "default": [],
                "default_1_thread": ["trainer.train_threads=1"],  # diagnostic: every switch but the threads
                "default_bf16": ["model.params_dtype=bf16"]}
    arms = {a: all_arms[a] for a in args.arms}
    records: dict[str, list[list[dict]]] = {a: [] for a in arms}
    load_start = os.getloadavg()
    walls: dict[str, list[float]] = {a: [] for a in arms}
    env = os.environ | {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false"}  # what `make demo` runs with
    for r in range(args.rounds):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):  # interleaved: alternate the order
            run_dir = os.path.join(args.root, f"{arm}_r{r}")
            out = os.path.join(run_dir, "bench.json")
            os.makedirs(run_dir, exist_ok=True)
            for name in ("metrics.jsonl",):
                if os.path.exists(os.path.join(run_dir, name)):
                    os.remove(os.path.join(run_dir, name))
            overrides = [f"logging.run_dir={run_dir}", f"trainer.total_steps={args.steps}", "checkpoint.resume=none",
                         *COMMON, *arms[arm]]
            t0 = time.perf_counter()
            subprocess.run([sys.executable, os.path.abspath(__file__), "--out", out, "--worker", *overrides],
                           cwd=REPO, env=env | {"MASTER_PORT": str(_free_port())}, check=True)
            walls[arm].append(time.perf_counter() - t0)
            with open(out) as f:
                got = json.load(f)
            records[arm].append([step_record(m, p, got["samples_per_step"])
                                 for m, p in zip(got["metrics"], got["passes"], strict=True)])
            print(f"round {r} {arm}: {summarise(records[arm][-1])['step']:.2f} s/step", flush=True)
    summary = {a: summarise([s for run in runs for s in run]) for a, runs in records.items()}
    ratios = {f"{a}_over_{b}": {p: summary[a][p] / summary[b][p] for p in PHASES if summary[b][p] > 0}
              for a, b in RATIOS if a in summary and b in summary}
    print(f"{'phase (s, mean of steps 2..N)':32s} " + " ".join(f"{a:>16s}" for a in arms)
          + " " + " ".join(f"{r:>28s}" for r in ratios))
    for p in PHASES:
        print(f"{p:32s} " + " ".join(f"{summary[a][p]:16.3f}" for a in arms) + " "
              + " ".join(f"{r.get(p, float('nan')):28.2f}" for r in ratios.values()))
    for k in ("forward_passes_per_sample", "update_padding_share", "all_padding_share", "reward_mean", "mismatch"):
        print(f"{k:32s} " + " ".join(f"{summary[a][k]:16.3f}" for a in arms))
    by_round = round_speedups(records) if "today" in records and "default" in records else None
    for p, per_round in (by_round or {"per_round": {}})["per_round"].items():
        print(f"today/default per round, {p}: {' '.join(f'{x:.2f}' for x in per_round)}; "
              f"median {by_round['median'][p]:.2f}")
    result = {
        "command": "python bench/demo_step.py " + " ".join(sys.argv[1:]),
        "config": "demo_cpu", "common_overrides": COMMON, "steps": args.steps, "rounds": args.rounds,
        "switches_today": dict(present), "absent_switches": absent, "arms": arms,
        "cores": len(os.sched_getaffinity(0)), "load_average_end": os.getloadavg(), "ratios": ratios,
        "speedup_today_over_default_by_round": by_round,
        "load_average_start": load_start, "summary": summary, "wall_s_per_run": walls, "per_step": records,
        "targets": {"train_phase": 3.0, "step": 2.0},
    }
    path = RESULTS_JSON if list(arms) == DEFAULT_ARMS else RESULTS_JSON.replace(".json", f"_{'_'.join(arms)}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
