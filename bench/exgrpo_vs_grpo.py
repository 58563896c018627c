"""ExGRPO vs on-policy GRPO, the paper's ablations and the weak-start regime, resumably.

Protocols (`--protocol`; every variant is a list of config overrides in bench/experiment_arms.py, never a code fork):
* paper_ratio (default; preset `conf/paper_ratio_cpu.yaml`): the paper's regime -- 360 distinct training questions
  per batch slot, ~1 epoch of fresh draws for ExGRPO and ~2 for GRPO, 2 updates per step, delayed start 0.35;
* fidelity (preset `conf/fidelity_cpu.yaml`): the earlier miniature (24 questions per batch slot), kept so its
  records (bench/results/fidelity_runs/) stay reproducible;
* scarce (presets `conf/scarce_256_cpu.yaml`, `conf/scarce_1024_cpu.yaml`): a fixed small training set over many
  epochs, replay that costs no generation against GRPO and GRPO with one more update pass, both starts, one rate
  (`SCARCE` in bench/experiment_arms.py); analysed against the criteria docs/results.md pre-registered
  (bench/scarce_analysis.py); each weak-start run also records the pass@8 probe of its training questions at its
  warm start and at its end (start_train_probe.json, train_probe.json).
Method:
* equal rollout budget: both arms run the same steps x B prompts x K rollouts; ExGRPO generates K-1 per replayed
  question (the stored trajectory is the K-th), so it gets at most as many generated trajectories as GRPO
  (counted and reported; curves are plotted against generated trajectories);
* learning rate: each arm sweeps `--lrs` (>= 4 values) on `--sweep-seeds`; its best rate is the one with the
  highest mean final VALIDATION accuracy (val/avg@1, T=0.6), reported with whether it is interior to the grid
  (extend `--lrs` until it is); the final numbers use that rate on `--seeds` (>= 5) and are measured on the
  separate TEST split (tools/arithmetic_eval.py test: greedy accuracy, avg@8 at T=0.6 and T=1.0);
* ablations (`ABLATIONS`, paper Tab. 6 and Tab. 3): at ExGRPO's best rate, `--ablation-seeds` (>= 3) seeds each;
* weak start (`WEAK_START`, paper Tab. 5's Llama-3.1-8B base): a shorter warm start (batch pass rate <= 10%),
  delayed start off, both arms at their chosen rates; the warm start itself is evaluated on the test split too
  (start_eval.json), so a run's final accuracy is compared with its start (collapse: below the start, or fresh
  reward 0 over the last 10% of steps);
* recipes (beyond the paper; `RECIPES`, `WEAK_RECIPES`): append replay, the authors' current recipe, an age bound,
  GRPO generating as much per step as append, the two arms again at this code version, and the weak start of each,
  at the rates the sweep chose, on `--seeds`; analysed per step and per generated trajectory
  (bench/recipe_analysis.py; tables appended to the .md, curves in <out>_recipes.png);
* stability / diagnosis (fidelity protocol): both arms at `--stability-lr-factor` x the largest rate; ExGRPO with
  its fresh tokens clipped in the mixed phase.
One precision (the preset pins model.params_dtype) and one code version per comparison: each run records the
commit that trained it (provenance.json). A run lives in `<root>/<variant>_lr<lr>_seed<seed>/` (git-ignored:
checkpoints, logs); when it finishes, its record (RECORD_FILES) is copied to `--records` (committed), and a run
with a record is never re-run, so the grid advances across sessions and machines. An interrupted run resumes from
its newest checkpoint (resume=auto); stopping the bench stops its runs (run_processes.py: they save on SIGTERM).
The analysis (bench/fidelity_analysis.py) reads the records only. Runs that share a warm start (same seed and
warm-start settings) share its cache: one trains it, the others wait.

    .venv/bin/python bench/exgrpo_vs_grpo.py --plan                  # runs, status, estimated CPU time
    .venv/bin/python bench/exgrpo_vs_grpo.py --phase sweep --jobs 1  # then final, ablation, weak_start, recipes
    .venv/bin/python bench/exgrpo_vs_grpo.py --analyse-only          # tables + JSON + PNG from what exists
    .venv/bin/python bench/exgrpo_vs_grpo.py --protocol fidelity --analyse-only   # the earlier miniature
    .venv/bin/python bench/exgrpo_vs_grpo.py --protocol scarce --plan  # then --jobs 2 (--seeds 1 .. 10 to extend)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
import fidelity_analysis as fa  # noqa: E402  (bench/, put on the path above)
import recipe_analysis as rc  # noqa: E402
import scarce_analysis as sa  # noqa: E402
from experiment_arms import (  # noqa: E402
    ABLATIONS,
    ARMS,
    DIAGNOSES,
    MATCHED_GRPO,
    RECIPES,
    SCARCE,
    SCARCE_LR,
    WEAK_RECIPES,
    WEAK_START,
    scarce_config_name,
    scarce_unavailable,
)
from run_processes import start_run, stop_runs  # noqa: E402
from run_records import RECORD_FILES, import_records, keep_record, note_provenance  # noqa: E402, F401

PHASES = ("sweep", "final", "ablation", "weak_start", "stability", "diagnosis", "recipes", "scarce")
PROTOCOLS: dict[str, dict] = {
    "paper_ratio": dict(config_name="paper_ratio_cpu", root="bench_paper_ratio", records="paper_ratio_runs",
                        out="exgrpo_vs_grpo_paper_ratio", lrs=[1.25e-5, 2.5e-5, 5e-5, 1e-4], sweep_seeds=[1, 2],
                        phases=["sweep", "final", "ablation", "weak_start", "recipes"]),
    "fidelity": dict(config_name="fidelity_cpu", root="bench_fidelity", records="fidelity_runs",
                     out="exgrpo_vs_grpo_fidelity", lrs=[2.5e-5, 5e-5, 1e-4], sweep_seeds=[1, 2, 3, 4, 5],
                     phases=["sweep", "final", "ablation", "stability", "diagnosis"]),
    "scarce": dict(config_name="scarce_256_cpu", root="bench_scarce", records="scarce_runs",
                   out="exgrpo_vs_grpo_scarce", lrs=[SCARCE_LR], sweep_seeds=[], phases=["scarce"],
                   step_seconds_records="paper_ratio_runs"),
}


@dataclass
class Run:
    phase: str
    variant: str  # an ARMS or ABLATIONS key
    lr: float
    seed: int
    run_dir: str
    record_dir: str  # the finished run's committed record (RECORD_FILES)
    config_name: str = ""  # its preset when not the protocol's (the data-scarce set sizes)

    @property
    def overrides(self) -> list[str]:
        return {**ARMS, **ABLATIONS, **DIAGNOSES, **WEAK_START, **RECIPES, **WEAK_RECIPES, **SCARCE}[self.variant]

    @property
    def weak_start(self) -> bool:
        """Started from the weak warm start (its test evaluation is recorded too, start_eval.json)."""
        return self.variant.startswith("weak_")

    @property
    def done(self) -> bool:
        return os.path.isfile(os.path.join(self.record_dir, "test_eval.json"))

    def keep_record(self) -> None:
        """Copy a finished run's record (test_eval.json last: its presence marks the record complete)."""
        keep_record(self.run_dir, self.record_dir)


def plan_runs(args: argparse.Namespace, best_lr: dict[str, float | None]) -> list[Run]:
    """Every run of the requested phases, deduplicated by run dir (a final seed that the sweep ran is reused)."""
    runs: dict[str, Run] = {}

    def add(phase: str, variant: str, lr: float | None, seeds: list[int], config_name: str = "") -> None:
        if lr is None:
            return
        for seed in seeds:
            d = fa.run_dir(args.root, variant, lr, seed)
            runs.setdefault(d, Run(phase, variant, lr, seed, d, fa.run_dir(args.records, variant, lr, seed),
                                   config_name))

    for phase in args.phase:
        for arm in ARMS:
            if phase == "sweep":
                for lr in args.lrs:
                    add(phase, arm, lr, args.sweep_seeds)
            elif phase == "final":
                add(phase, arm, best_lr[arm], args.seeds)
            elif phase == "stability":
                add(phase, arm, max(args.lrs) * args.stability_lr_factor, args.ablation_seeds)
            elif phase == "weak_start":
                add(phase, f"weak_{arm}", best_lr[arm], args.seeds)
        if phase == "ablation":
            for name in ABLATIONS:
                add(phase, name, best_lr["exgrpo"], args.ablation_seeds)
        if phase == "recipes":
            for name in [*RECIPES, *WEAK_RECIPES]:  # each at the rate the sweep chose for its algorithm
                add(phase, name, best_lr["grpo" if name.removeprefix("weak_").startswith("grpo") else "exgrpo"],
                    args.seeds)
        if phase == "scarce":  # one rate for every arm (pre-registered), no sweep
            for name in [n for n in SCARCE if n not in scarce_unavailable()]:  # arms whose keys this code version has
                add(phase, name, SCARCE_LR, args.seeds, scarce_config_name(name))
        if phase == "diagnosis":
            for name in DIAGNOSES:
                for lr in (best_lr["grpo"], max(args.lrs) * args.stability_lr_factor):
                    add(phase, name, lr, args.ablation_seeds)
    chosen = [r for r in runs.values() if not args.variants or r.variant in args.variants]
    return sorted(chosen, key=lambda r: (PHASES.index(r.phase), r.seed, r.lr, r.variant))


def train_argv(args: argparse.Namespace, run: Run) -> list[str]:
    return [sys.executable, "-m", "exgrpo_megatron.train", "--config-name", run.config_name or args.config_name,
            f"seed={run.seed}",
            f"optim.lr={run.lr:g}", f"logging.run_dir={run.run_dir}", "logging.tensorboard=false",
            "logging.progress_bar=false", "checkpoint.resume=auto", f"trainer.sft_cache_dir={args.sft_cache}",
            f"trainer.train_threads={args.threads}",  # auto would take every core in each of --jobs runs
            *args.override, *run.overrides]


def eval_argv(args: argparse.Namespace, run: Run) -> list[str]:
    """The test-split evaluation of the finished run, preceded for weak-start runs by that of its warm start, and for
    the data-scarce weak-start runs by the pass@8 probe (T = 1, per-question counts) of the training questions at the
    warm start and at the end (test_eval.json last: it marks the record complete)."""
    tool = [sys.executable, os.path.join(REPO, "tools", "arithmetic_eval.py"), "test", "--run-dir", run.run_dir]
    final = [*tool, "--out", os.path.join(run.run_dir, "test_eval.json")]
    if not run.weak_start:
        return final
    weights = ["--weights", os.path.dirname(warm_start_ready(args, run))]
    start = [*tool, *weights, "--out", os.path.join(run.run_dir, "start_eval.json")]
    if run.phase != "scarce":
        return [*start, "&&", *final]
    probe = [*tool, "--split", "train", "--temperatures", "1.0", "--counts"]
    return [*start, "&&", *probe, *weights, "--out", os.path.join(run.run_dir, "start_train_probe.json"), "&&",
            *probe, "--out", os.path.join(run.run_dir, "train_probe.json"), "&&", *final]


def warm_start_ready(args: argparse.Namespace, run: Run) -> str:
    """Path whose existence means the run's warm start is cached (same key as the trainer computes)."""
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.policy.warm_start import cache_key

    cfg = load_config(run.config_name or args.config_name, [
        f"seed={run.seed}", f"trainer.sft_cache_dir={args.sft_cache}", *args.override, *run.overrides])
    return os.path.join(args.sft_cache, cache_key(cfg), "model_config.yaml")


def execute(args: argparse.Namespace, runs: list[Run]) -> list[str]:
    """Run the pending runs (train, then test) `--jobs` at a time; returns failures. Its runs stop when it does."""
    running: dict[str, tuple[Run, subprocess.Popen, float]] = {}
    try:
        return _schedule(args, runs, running)
    finally:
        stop_runs(proc for _, proc, _ in running.values())


def _schedule(args: argparse.Namespace, runs: list[Run], running: dict[str, tuple]) -> list[str]:
    from exgrpo_megatron.distributed.launch_env import free_local_port
    for run in runs:  # finished here before records existed (or before an interrupted copy)
        if not run.done and os.path.isfile(os.path.join(run.run_dir, "test_eval.json")):
            run.keep_record()
    pending = [r for r in runs if not r.done]
    ready = {r.run_dir: warm_start_ready(args, r) for r in pending}
    warming: set[str] = set()
    failed = []
    while pending or running:
        for run in list(pending):
            if len(running) >= args.jobs:
                break
            if not os.path.isfile(ready[run.run_dir]):
                if ready[run.run_dir] in warming:
                    continue  # another run is training the shared warm start
                warming.add(ready[run.run_dir])
            os.makedirs(run.run_dir, exist_ok=True)
            note_provenance(run.run_dir)
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MASTER_PORT=str(free_local_port()),
                       HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                       PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
            for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
                env.pop(var, None)
            evals = " ".join(a if a == "&&" else shlex.quote(a) for a in eval_argv(args, run))
            script = f"{shlex.join(train_argv(args, run))} && {evals}"
            print(f"[bench] start {os.path.basename(run.run_dir)} ({run.phase})", file=sys.stderr)
            with open(os.path.join(run.run_dir, "bench.log"), "a") as log:
                proc = start_run(script, REPO, env, log)
            running[run.run_dir] = (run, proc, time.perf_counter())
            pending.remove(run)
        time.sleep(2.0)
        for key, (finished, proc, t0) in list(running.items()):
            if proc.poll() is not None:
                print(f"[bench] done {os.path.basename(key)}: rc={proc.returncode} {time.perf_counter() - t0:.0f}s",
                      file=sys.stderr)
                if proc.returncode != 0:
                    failed.append(f"{key} rc={proc.returncode} (log {key}/bench.log)")
                else:
                    finished.keep_record()
                del running[key]
                cache = ready[key]
                if not os.path.isfile(cache):  # its warm start failed: the runs sharing it cannot start
                    failed += [f"{r.run_dir} (no warm start {cache})" for r in pending if ready[r.run_dir] == cache]
                    pending = [r for r in pending if ready[r.run_dir] != cache]
    return failed


def estimate_cpu_s(args: argparse.Namespace, runs: list[Run], seconds_per_step: float,
                   unplanned: list[str] | None = None) -> dict[str, float]:
    """CPU seconds of the runs still to do: steps x seconds/step, validation, test evaluation (and the training-split
    probes of the data-scarce weak-start runs), one warm start per new seed, from each run's own preset
    (single-thread seconds measured on this machine; scale by 1/parallel jobs for wall time). `unplanned`: runs that
    wait for the sweep's learning-rate choice or for their arm's code, each named by its preset and counted at its
    cost. Every arm is counted at the measured seconds per step (the arms that train more rows per step, in-group
    replay and the extra update pass, cost more)."""
    from exgrpo_megatron.config.loader import load_config

    def cost(config_name: str, overrides: list[str], probe: bool) -> tuple[float, float]:
        cfg = load_config(config_name, [*args.override, *overrides])
        t, d = cfg.trainer, cfg.data
        per_sample = seconds_per_step * 0.5 / (t.train_batch_size * cfg.rollout.n)  # generation: ~half a step
        samples = (t.total_steps // max(t.val_every, 1)) * d.num_val_examples + d.num_test_examples * 17 \
            + (2 * d.num_train_examples * 9 if probe else 0)  # val avg@1; test greedy + 2 x avg@8; probes
        return t.total_steps * seconds_per_step + samples * per_sample, t.sft_warm_start_steps * \
            args.warm_start_step_seconds

    todo = [r for r in runs if not r.done]
    costs = [cost(r.config_name or args.config_name, r.overrides, r.phase == "scarce" and r.weak_start) for r in todo]
    unplanned = unplanned or []
    train_s = sum(c for c, _ in costs) + sum(cost(name, [], False)[0] for name in unplanned)
    warm = {warm_start_ready(args, r): w for r, (_, w) in zip(todo, costs, strict=True)}
    warm_s = sum(w for path, w in warm.items() if not os.path.isfile(path))
    return {"runs_total": len(runs) + len(unplanned), "runs_todo": len(todo) + len(unplanned),
            "runs_not_planned_yet": len(unplanned), "train_eval_cpu_s": round(train_s),
            "warm_start_cpu_s": round(warm_s), "total_cpu_h": round((train_s + warm_s) / 3600, 2)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="paper_ratio",
                   help="preset, run/record folders, rate grid, sweep seeds and phases (flags below override)")
    p.add_argument("--config-name", default=None)
    p.add_argument("--root", default=None, help="run directories (default runs/<protocol root>)")
    p.add_argument("--records", default=None,
                   help="finished runs' records (committed; default bench/results/<protocol records>)")
    p.add_argument("--phase", nargs="+", choices=PHASES, default=None)
    p.add_argument("--lrs", type=float, nargs="+", default=None)
    p.add_argument("--sweep-seeds", type=int, nargs="+", default=None,
                   help="seeds of the rate sweep; the final seeds reuse its runs at the chosen rates")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--ablation-seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--stability-lr-factor", type=float, default=3.0,
                   help="x the largest swept rate (demo_cpu: 2e-4 and 3e-4 blew the entropy up)")
    p.add_argument("--variants", nargs="+", default=None,
                   help="only these arms/ablations/diagnoses of the phases (e.g. rho_0.25 rho_0.75); default all")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each one process)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--override", nargs="*", default=[], help="extra overrides for every run")
    p.add_argument("--threshold", type=float, default=0.5, help="validation accuracy for trajectories-to-threshold")
    p.add_argument("--plan", action="store_true", help="print the runs and the estimated CPU time; run nothing")
    p.add_argument("--analyse-only", action="store_true")
    p.add_argument("--import-records", metavar="DIR", default=None,
                   help="first copy the finished records under DIR (the --records of a checkout pinned at the "
                        "comparison's code version) that --records lacks, compressed; then go on as asked")
    p.add_argument("--step-seconds", type=float, default=None,
                   help="seconds per RL step for --plan (default: median of finished runs, else 6.0)")
    p.add_argument("--warm-start-step-seconds", type=float, default=1.5)
    p.add_argument("--out-json", default=None)
    p.add_argument("--out-png", default=None)
    args = p.parse_args(argv)
    proto = PROTOCOLS[args.protocol]
    args.config_name = args.config_name or proto["config_name"]
    args.root = os.path.abspath(args.root or os.path.join(REPO, "runs", proto["root"]))
    args.records = os.path.abspath(args.records or os.path.join(HERE, "results", proto["records"]))
    args.phase = args.phase or proto["phases"]
    args.lrs = args.lrs or proto["lrs"]
    args.sweep_seeds = args.sweep_seeds or proto["sweep_seeds"]
    args.out_json = args.out_json or os.path.join(HERE, "results", proto["out"] + ".json")
    args.out_png = args.out_png or os.path.join(HERE, "results", proto["out"] + ".png")
    args.sft_cache = os.path.join(args.root, "sft_cache")
    args.step_seconds_records = os.path.join(HERE, "results", proto.get("step_seconds_records", proto["records"]))
    if args.protocol == "scarce":
        if len(args.seeds) < 5:
            print("[bench] note: fewer than 5 paired seeds is below the pre-registered protocol", file=sys.stderr)
    elif len(args.lrs) < 4 or len(args.seeds) < 5 or len(args.ablation_seeds) < 3:
        print("[bench] note: fewer than 4 rates / 5 final seeds / 3 ablation seeds is below the protocol",
              file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.import_records:
        print(f"[bench] imported {import_records(args.import_records, args.records)}", file=sys.stderr)
    best = ({arm: None for arm in ARMS} if args.protocol == "scarce"  # one pre-registered rate, no sweep
            else fa.best_learning_rates(args.records, list(ARMS), args.lrs, args.sweep_seeds))
    runs = plan_runs(args, {arm: b["lr"] if b else None for arm, b in best.items()})
    step_s = args.step_seconds or fa.median_step_seconds(args.records) or fa.median_step_seconds(
        args.step_seconds_records) or 6.0
    if args.plan:
        for r in runs:
            state = "done" if r.done else ("partial" if os.path.isdir(r.run_dir) else "todo")
            print(f"{r.phase:9s} {os.path.basename(r.run_dir):48s} {state}")
        unplanned = 0
        if "final" in args.phase:
            unplanned += sum(len(set(args.seeds) - set(args.sweep_seeds)) for arm in ARMS if best[arm] is None)
        if "ablation" in args.phase and best["exgrpo"] is None:
            unplanned += len(ABLATIONS) * len(args.ablation_seeds)
        if "recipes" in args.phase and (best["exgrpo"] is None or best["grpo"] is None):
            unplanned += (len(RECIPES) + len(WEAK_RECIPES)) * len(args.seeds)
        if unplanned:
            print(f"({unplanned} final/ablation runs wait for the sweep's validation results to pick the learning "
                  "rate; re-plan after the sweep to list them)")
        waiting = [args.config_name] * unplanned
        for name, why in scarce_unavailable().items() if "scarce" in args.phase else ():
            print(f"({name}: {len(args.seeds)} runs not planned, this code version cannot run them: {why})")
            waiting += [scarce_config_name(name)] * len(args.seeds)
        print(json.dumps({"seconds_per_step": step_s, **estimate_cpu_s(args, runs, step_s, waiting)}))
        return 0
    failed = [] if args.analyse_only else execute(args, runs)
    if args.protocol == "scarce":
        return sa.write_summary(args.records, args.seeds, args.out_json, args.out_png, failed, {
            "command": shlex.join(["bench/exgrpo_vs_grpo.py", *(argv if argv is not None else sys.argv[1:])]),
            "variant_overrides": SCARCE, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg()})
    summary = fa.analyse(args.records, ARMS, ABLATIONS, best, args.seeds, args.ablation_seeds, args.threshold,
                         args.lrs, args.stability_lr_factor, args.out_png, DIAGNOSES, args.sweep_seeds)
    summary["recipes"] = rc.analyse_recipes(args.records, RECIPES, WEAK_RECIPES, MATCHED_GRPO, best, args.seeds,
                                            args.threshold, os.path.splitext(args.out_png)[0] + "_recipes.png")
    summary.update(command=shlex.join(["bench/exgrpo_vs_grpo.py", *(argv if argv is not None else sys.argv[1:])]),
                   config_name=args.config_name, arm_overrides=ARMS, ablation_overrides=ABLATIONS, lrs=args.lrs,
                   diagnosis_overrides=DIAGNOSES, weak_start_overrides=WEAK_START, sweep_seeds=args.sweep_seeds,
                   recipe_overrides={**RECIPES, **WEAK_RECIPES},
                   seeds=args.seeds,
                   ablation_seeds=args.ablation_seeds,
                   failed_runs=failed, cpu_count=os.cpu_count(), loadavg=os.getloadavg())
    summary["markdown"] = fa.markdown_tables(summary) + "\n\n" + rc.markdown(summary["recipes"])  # also beside the JSON
    os.makedirs(os.path.dirname(args.out_json), exist_ok=True)
    with open(args.out_json, "w") as fh:
        json.dump(summary, fh, indent=1)
    with open(os.path.splitext(args.out_json)[0] + ".md", "w") as fh:
        fh.write(summary["markdown"] + "\n")
    fa.print_tables(summary)
    print(f"wrote {args.out_json} and {args.out_png}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwinds execute(): stops its runs
    sys.exit(main())
