"""Random SIGKILL trials against an uninterrupted run: does every resume end bitwise equal, and how many
steps does a kill cost?

The run is the tiny one of tests/test_trainer_resume.py (tiny Qwen2, digit_policy init so rewards, the
pool and replay are non-trivial from step 1; 6 steps, checkpoint every 2, model + Adam + LR scheduler +
pool + RNG + sampler state in every checkpoint). Once: the uninterrupted reference. Then per trial: the
same run from scratch, SIGKILLed at a random instant, then resumed with checkpoint.resume=auto to the
end. A quarter of the trials kill during start-up (uniform over the reference's time to its first logged
step); the others wait for the first logged step and kill uniformly within the reference's training
window (first logged step to exit: steps, saves at any depth, renames, the final save, shutdown). A trial
matches when the resumed run's per-step metrics (all but timings), final weights, Adam moments, optimizer
step, LR scheduler, trainer state and pool shards are bitwise the reference's.
steps redone = steps the killed run had logged beyond the checkpoint the resume started from.

Scenarios (`--scenarios`; default all): bench/reliability_trials.py's -- a second launch on the run dir, a disk that
fills during a save (a real tmpfs, needs root), a corrupted token-cache entry, config changes on resume -- and
bench/process_trials.py's -- the trainer SIGKILLed by its own forked checkpoint writer then relaunched at once, a group
SIGTERM / SIGUSR1 while generating one step ahead, the generator stopped or killed, damaged parquet files, a busy
exported MASTER_PORT, SIGTERM / SIGUSR1 to the group while the generator is stopped, a nearly full disk at start-up, the
trainer SIGKILLed / SIGABRTed while its results Manager and grader pool live -- and bench/ep_trials.py's -- EP=2 runs
of the MoE demo under torchrun with one rank SIGKILLed and with torchrun's group sent SIGTERM (each also counts the
orphans: the run's processes alive after its trainer, or torchrun, exited). Each reports
what it expected and observed and whether nothing was lost (the run still ends bitwise equal to the reference, or as
the scenario states).
`--trials 0 --scenarios all` runs only those; finished kill trials already in the results file are kept.
`--max-staleness 1`: the same kill trials for a run generating one step ahead (a generator process, the in-flight
plan and rollouts in each checkpoint; docs/async_generation.md), written to fault_trials_ahead.json.

Resumable (the machine is shared: run it in the background): each finished trial is appended to the
results file, and a restart continues with the next trial (the reference is kept in the work dir).

    nohup env OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/fault_trials.py --trials 20 \
        > /tmp/fault_trials.log 2>&1 &
    # -> bench/results/fault_trials.json
    # the process scenarios alone, into their own file:
    .venv/bin/python bench/fault_trials.py --trials 0 --results bench/results/fault_trials_process.json \
        --scenarios trainer_killed_in_save,group_sigterm,group_sigusr1,generator_sigstop,generator_sigkill,\
    parquet_empty,parquet_garbage,parquet_no_answer,busy_port,stopped_generator_sigterm,stopped_generator_sigusr1,\
    disk_nearly_full,trainer_sigkill_with_helpers,trainer_sigabrt_with_helpers
    # the EP=2 scenarios (ep_reference first: ep_group_sigterm compares with it):
    .venv/bin/python bench/fault_trials.py --trials 0 --results bench/results/fault_trials_ep.json \
        --scenarios ep_reference,ep_rank_sigkill,ep_group_sigterm
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.ep_trials import SCENARIOS as EP_SCENARIOS  # noqa: E402
from bench.process_trials import SCENARIOS as PROCESS_SCENARIOS  # noqa: E402
from bench.reliability_trials import SCENARIOS as INPUT_SCENARIOS  # noqa: E402
from bench.reliability_trials import run_scenarios  # noqa: E402
from exgrpo_megatron.distributed.launch_env import free_local_port as free_port  # noqa: E402
from tests.helpers.rank_processes import reap, start_rank_process  # noqa: E402
from tests.test_generate_ahead import AHEAD, _untimed  # noqa: E402
from tests.test_trainer_resume import (  # noqa: E402
    N_STEPS,
    _comparable,
    _model_tensors,
    _overrides,
    _pool_shards,
    _write_dataset,
)

SCENARIOS = {**INPUT_SCENARIOS, **PROCESS_SCENARIOS, **EP_SCENARIOS}
RESULTS = REPO / "bench" / "results" / "fault_trials.json"
RESULTS_AHEAD = REPO / "bench" / "results" / "fault_trials_ahead.json"
TIMEOUT_S = 900


def launch(run_dir: Path, overrides: list[str], tag: str, worker_args: tuple[str, ...] = ()):
    run_dir.mkdir(parents=True, exist_ok=True)
    args = ["-m", "tests.trainer_resume_worker", str(run_dir), *worker_args, "--", *overrides]
    return start_rank_process(args, run_dir / f"{tag}.log", 0, 1, free_port())


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a torn last line
    return out


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def same_final_state(run_dir: Path, ref_dir: Path, scratch: Path) -> tuple[bool, str]:
    """Bitwise comparison with the reference: metrics, model/optimizer tensors, state files, pool shards."""
    got, want = metrics(run_dir), metrics(ref_dir)
    if [_comparable(r) for r in got] != [_comparable(r) for r in want]:
        return False, "metrics differ"
    a, b = ckpt(run_dir, N_STEPS), ckpt(ref_dir, N_STEPS)
    ta, tb = _model_tensors(a, scratch), _model_tensors(b, scratch)
    if set(ta) != set(tb):
        return False, "tensor keys differ"
    for key in tb:
        same = repr(ta[key]) == repr(tb[key]) if key == "common" else torch.equal(ta[key], tb[key])
        if not same:
            return False, f"tensor {key} differs"
    for name in ("trainer_state.json", "opt_param_scheduler.json"):
        if _untimed(json.loads((a / "state" / name).read_text())) != _untimed(json.loads((b / "state" / name)
                                                                                          .read_text())):
            return False, f"{name} differs"
    for (arrays, meta), (want_arrays, want_meta) in zip(_pool_shards(a), _pool_shards(b), strict=True):
        if meta != want_meta or set(arrays) != set(want_arrays):
            return False, "pool meta differs"
        if not all(np.array_equal(arrays[k], want_arrays[k]) for k in arrays):
            return False, "pool arrays differ"
    return True, "bitwise equal"


def reference(work: Path, data: str, init: Path, extra: tuple[str, ...]) -> dict:
    """Run (once) the uninterrupted reference; returns its wall time and time to the first logged step."""
    ref_dir = work / "reference"
    info = work / "reference.json"
    if info.exists():
        return json.loads(info.read_text())
    if ref_dir.exists():
        shutil.rmtree(ref_dir)
    t0 = time.perf_counter()
    proc = launch(ref_dir, _overrides(data, N_STEPS, extra=extra), "run", ("--make-init", str(init)))
    first_step = None
    while proc.poll() is None:
        if first_step is None and metrics(ref_dir):
            first_step = time.perf_counter() - t0
        time.sleep(0.02)
    code = reap(proc, TIMEOUT_S)
    wall = time.perf_counter() - t0
    if code != 0 or len(metrics(ref_dir)) != N_STEPS or first_step is None:
        raise SystemExit(f"reference run failed (exit {code}); see {ref_dir / 'run.log'}")
    out = {"wall_s": wall, "first_step_s": first_step}
    info.write_text(json.dumps(out))
    return out


def trial(index: int, work: Path, data: str, ref: dict, seed: int, extra: tuple[str, ...]) -> dict:
    rng = np.random.default_rng([seed, index])
    phase = "startup" if rng.random() < 0.25 else "training"
    window = ref["first_step_s"] if phase == "startup" else ref["wall_s"] - ref["first_step_s"]
    kill_at = float(rng.uniform(0.0, window))
    run_dir = work / f"trial_{index:03d}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = _overrides(data, N_STEPS, extra=extra)
    make_init = ("--make-init", str(run_dir / "init"))  # as the reference: weights-only init, then train from it
    proc = launch(run_dir, overrides, "killed", make_init)
    t0 = time.perf_counter()
    while phase == "training" and proc.poll() is None and not metrics(run_dir):
        time.sleep(0.02)  # the clock of a training-phase kill starts at the first logged step
    t0 = t0 if phase == "startup" else time.perf_counter()
    while proc.poll() is None and time.perf_counter() - t0 < kill_at:
        time.sleep(0.02)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    reap(proc, TIMEOUT_S)
    logged_before = max((r["step"] for r in metrics(run_dir)), default=0)
    complete = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() \
        else []
    partial = sorted(p.name for p in (run_dir / "checkpoints").glob(".tmp_*")) if complete or \
        (run_dir / "checkpoints").exists() else []

    resumed = launch(run_dir, overrides, "resumed", make_init)
    code = reap(resumed, TIMEOUT_S)
    log = (run_dir / "resumed.log").read_text()
    found = re.search(r"resumed from \S+ at step (\d+)", log)
    resumed_step = int(found.group(1)) if found else 0
    match, why = same_final_state(run_dir, work / "reference", run_dir) if code == 0 else (False, f"exit {code}")
    return {"trial": index, "phase": phase, "kill_at_s": round(kill_at, 3), "killed": killed,
            "steps_logged_before_kill": logged_before,
            "checkpoints_at_kill": complete, "partial_saves_at_kill": partial, "resumed_from_step": resumed_step,
            "steps_redone": max(logged_before - resumed_step, 0), "resume_exit_code": code, "bitwise_match": match,
            "detail": why}


def summary(trials: list[dict], ref: dict) -> dict:
    killed = [t for t in trials if t["killed"]]
    return {
        "trials": len(trials), "killed_mid_run": len(killed),
        "bitwise_matches": sum(t["bitwise_match"] for t in trials),
        "steps_redone_total": sum(t["steps_redone"] for t in trials),
        "steps_redone_max": max((t["steps_redone"] for t in trials), default=0),
        "killed_before_first_checkpoint": sum(not t["checkpoints_at_kill"] for t in killed),
        "killed_with_a_partial_save": sum(bool(t["partial_saves_at_kill"]) for t in killed),
        "killed_during_startup": sum(t["phase"] == "startup" for t in killed),
        "reference_wall_s": round(ref["wall_s"], 1), "reference_first_step_s": round(ref["first_step_s"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--work-dir", default="/tmp/exgrpo_fault_trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="trials run side by side (independent run dirs)")
    parser.add_argument("--max-staleness", type=int, default=0, help="> 0: trials of a run generating ahead")
    parser.add_argument("--results", default=None, help=f"results file (default {RESULTS.relative_to(REPO)}, "
                        f"{RESULTS_AHEAD.relative_to(REPO)} with --max-staleness)")
    parser.add_argument("--scenarios", default="all",
                        help=f"comma-separated scenarios after the kill trials: {', '.join(SCENARIOS)}; all; '' none")
    args = parser.parse_args()
    extra: tuple[str, ...] = ()
    results_path = RESULTS
    if args.max_staleness > 0:
        extra = (f"rollout.max_staleness={args.max_staleness}",
                 *(o for o in AHEAD if not o.startswith("rollout.max_staleness=")))
        results_path = RESULTS_AHEAD
        args.work_dir += "_ahead"
    results_path = Path(args.results) if args.results else results_path
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = str(work / "train.jsonl")
    if not Path(data).exists():
        _write_dataset(Path(data))
    init = work / "init"
    previous = json.loads(results_path.read_text()) if results_path.exists() else {}
    done = previous.get("per_trial", [])
    scenarios = previous.get("scenarios", [])
    todo = [i for i in range(args.trials) if i not in {t["trial"] for t in done}]
    names = list(SCENARIOS) if args.scenarios == "all" else [n for n in args.scenarios.split(",") if n]
    names = [] if args.max_staleness > 0 else names  # the scenarios are the colocated run's
    # the kill trials, the input scenarios and trainer_killed_in_save compare with the tiny uninterrupted run
    needs_reference = todo or any(n in INPUT_SCENARIOS or n == "trainer_killed_in_save" for n in names)
    ref = reference(work, data, init, extra) if needs_reference else {"wall_s": 0.0, "first_step_s": 0.0}
    lock = threading.Lock()

    def write_results() -> None:
        out = {"config": {"steps": N_STEPS, "save_every": 2, "keep_last": 3, "world_size": 1, "seed": args.seed,
                          "overrides": list(extra),
                          "kill": "SIGKILL: 1/4 uniform over the reference's start-up (launch to first "
                                  "logged step), 3/4 uniform over its training window (first logged step "
                                  "to exit), timed from the first logged step"},
               "summary": summary(done, ref) | scenario_summary(scenarios), "per_trial": done, "scenarios": scenarios}
        results_path.write_text(json.dumps(out, indent=1) + "\n")

    def run_one(index: int) -> None:
        result = trial(index, work, data, ref, args.seed, extra)
        with lock:
            done.append(result)
            done.sort(key=lambda t: t["trial"])
            write_results()
            print(f"trial {index}: kill at {result['kill_at_s']}s, logged {result['steps_logged_before_kill']}, "
                  f"resumed from {result['resumed_from_step']}, redone {result['steps_redone']}, "
                  f"{result['detail']}", flush=True)

    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        list(pool.map(run_one, todo))
    helpers = SimpleNamespace(launch=launch, reap=reap, metrics=metrics, same_final_state=same_final_state,
                              reference=reference)
    for result in run_scenarios(names, helpers, work, data, SCENARIOS):
        scenarios[:] = [s for s in scenarios if s["scenario"] != result["scenario"]] + [result]
        write_results()
    final = json.loads(results_path.read_text())["summary"] if results_path.exists() else summary(done, ref)
    print(f"{'trials':>8} {'bitwise':>8} {'redone':>7} {'max':>4}  (steps redone: total, max per trial)")
    print(f"{final['trials']:>8} {final['bitwise_matches']:>8} {final['steps_redone_total']:>7} "
          f"{final['steps_redone_max']:>4}")
    print(f"{'scenario':<22} {'as expected':>11} {'nothing lost':>12} {'orphans':>7}  observed")
    for sc in scenarios:
        orphans = sc.get("orphans", "-")
        print(f"{sc['scenario']:<22} {sc['as_expected']!s:>11} {sc['nothing_lost']!s:>12} {orphans!s:>7}  "
              f"{sc['observed'][:150]}")


def scenario_summary(scenarios: list[dict]) -> dict:
    return {"scenarios": len(scenarios), "scenarios_as_expected": sum(s["as_expected"] for s in scenarios),
            "scenarios_nothing_lost": sum(s["nothing_lost"] for s in scenarios),
            "scenario_orphans": sum(s.get("orphans", 0) for s in scenarios)}


if __name__ == "__main__":
    main()
