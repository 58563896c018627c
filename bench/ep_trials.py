"""EP=2 process-fault scenarios for bench/fault_trials.py (`--scenarios`): the MoE demo (conf/demo_moe_cpu.yaml, two
ranks under torchrun, its experts split over both) made small (EP_OVERRIDES: 5 steps of 4 prompts x 4 rollouts, a
4-step supervised warm start cached in the work dir, a checkpoint every 2 steps). Each rank runs exgrpo-train's entry
point through bench/ep_rank.py, which records the rank's exit code (torchrun reports none once it is signalled).
Orphans: every process the run started (torchrun, its workers and all below them, followed across the sessions
torchrun gives its workers, sampled every 0.1 s) still alive 15 s after torchrun exited.

ep_reference      the uninterrupted run (for ep_group_sigterm's comparison; run it first)
ep_rank_sigkill   rank 1 SIGKILLed once checkpoint 2 is on disk -> rank 0 exits 1 with the one-line "lost its
                  connection" message (or 5 from the collective watch), torchrun exits, no process left, checkpoint 2
                  verifies; the relaunch (checkpoint.resume=auto) finishes every step
ep_group_sigterm  SIGTERM to torchrun's process group once step 2 is logged (during the first save) /
ep_group_sigterm_after_save  once checkpoint 2 is on disk (torchrun passes it on to its workers) -> each rank
                  saves and exits 75; the requeued run finishes every step once, its metrics equal to ep_reference's
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.reliability_trials import (
    RUN_TIMEOUT_S,
    _fresh,
    _verdict,
    checkpoint_problem,
    orphans_within,
    run_processes,
)
from exgrpo_megatron.distributed.launch_env import free_local_port
from tests.test_trainer_resume import _comparable

REPO = Path(__file__).resolve().parents[1]
EP_STEPS = 5
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


def _ep_overrides(work: Path, run_dir: Path) -> list[str]:
    return [f"logging.run_dir={run_dir}", "model.params_dtype=fp32", f"trainer.sft_cache_dir={work / 'ep_sft'}",
            "trainer.sft_warm_start_steps=4", f"trainer.total_steps={EP_STEPS}", "trainer.train_batch_size=4",
            "trainer.ppo_mini_batch_size=2", "rollout.n=4", "data.max_response_length=24", "data.num_val_examples=1",
            "data.num_train_examples=256", "trainer.val_every=0", "checkpoint.save_every=2", "checkpoint.resume=auto",
            "experience.delayed_start_pass_rate=0", "experience.admit_correct_at_most=3", "logging.tensorboard=false",
            "logging.progress_bar=false", "reward.num_workers=1", "reward.timeout_seconds=30",
            "reward.hard_deadline_seconds=120"]


def _torchrun(base: Path, overrides: list[str], tag: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS} | {
        "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_local_port()), "-m", "bench.ep_rank", str(base / f"{tag}_exit"), "--config-name", "demo_moe_cpu",
           *overrides]
    with open(base / f"{tag}.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _workers(torchrun: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes."""
    out = {}
    for pid, _start in run_processes(torchrun):
        try:
            env = dict(x.split("=", 1) for x in open(f"/proc/{pid}/environ").read().split("\0") if "=" in x)
        except OSError:
            continue
        if "RANK" in env and pid != torchrun and "bench.ep_rank" in open(f"/proc/{pid}/cmdline").read():
            out[int(env["RANK"])] = pid
    return out


def _track(proc: subprocess.Popen, seen: set, until: Callable[[], bool] = lambda: False) -> None:
    """Record the run's processes every 0.1 s until `until()` or the run's end."""
    end = time.monotonic() + RUN_TIMEOUT_S
    while proc.poll() is None and not until() and time.monotonic() < end:
        seen |= run_processes(proc.pid)
        time.sleep(0.1)


def _finish(proc: subprocess.Popen, seen: set) -> tuple[int, list[int], float]:
    """torchrun's exit code, the run's processes alive 15 s after it, and how long after its exit the last went."""
    _track(proc, seen)
    code = proc.wait(timeout=60)
    orphans, took = orphans_within(seen, [proc.pid, *{pid for pid, _ in seen}], 15.0)
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)  # the bench leaves nothing behind either way
        except ProcessLookupError:
            pass
    return code, orphans, took


def _exits(base: Path, tag: str) -> dict[int, str]:
    return {r: (base / f"{tag}_exit" / f"rank{r}").read_text() if (base / f"{tag}_exit" / f"rank{r}").exists()
            else "none (killed)" for r in range(2)}


def _run_to_end(h, base: Path, overrides: list[str], tag: str) -> tuple[int, list[int], list[int]]:
    seen: set = set()
    proc = _torchrun(base, overrides, tag)
    code, orphans, _ = _finish(proc, seen)
    return code, orphans, [r["step"] for r in h.metrics(base / "run")]


def ep_reference(h, work: Path, data: str) -> dict:
    base = _fresh(work / "ep_reference")
    code, orphans, steps = _run_to_end(h, base, _ep_overrides(work, base / "run"), "run")
    return _verdict("ep_reference", f"exit 0, steps 1..{EP_STEPS} logged, no orphan",
                    f"torchrun exit {code}, ranks {_exits(base, 'run')}, steps {steps}, orphans {len(orphans)}",
                    code == 0 and steps == list(range(1, EP_STEPS + 1)) and not orphans, (True, "uninterrupted"),
                    orphans=len(orphans))


def ep_rank_sigkill(h, work: Path, data: str) -> dict:
    base = _fresh(work / "ep_rank_sigkill")
    run_dir = base / "run"
    overrides = _ep_overrides(work, run_dir)
    seen: set = set()
    proc = _torchrun(base, overrides, "killed")
    _track(proc, seen, lambda: (run_dir / "checkpoints" / "step_00000002").exists())
    workers = _workers(proc.pid)
    logged = [r["step"] for r in h.metrics(run_dir)]
    os.kill(workers[1], signal.SIGKILL)
    t0 = time.monotonic()
    code, orphans, gone_s = _finish(proc, seen)
    took = time.monotonic() - t0
    log = (base / "killed.log").read_text(errors="replace")
    lost = next((x for x in log.splitlines() if "lost its connection" in x), "")
    watch = next((x for x in log.splitlines() if "collective" in x and "exgrpo-train" in x), "")
    exits = _exits(base, "killed")
    gloo_traceback = any(x.startswith("RuntimeError") and "Connection closed by peer" in x for x in log.splitlines())
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    problem = checkpoint_problem(run_dir / "checkpoints" / saved[-1]) if saved else "no checkpoint"
    code2, orphans2, steps = _run_to_end(h, base, overrides, "relaunched")
    found = re.search(r"resumed from \S+ at step (\d+)", (base / "relaunched.log").read_text(errors="replace"))
    complete = code2 == 0 and steps == list(range(1, EP_STEPS + 1))
    observed = (f"killed rank 1 (pid {workers.get(1)}) with steps {logged} logged; torchrun exit {code} "
                f"{took:.0f} s later; rank exits {exits}; survivor's message: {(lost or watch).strip()[:300]!r}; "
                f"gloo's error as a traceback: {gloo_traceback}; processes seen "
                f"{len(seen)}, alive 15 s after torchrun {len(orphans)} (last gone {gone_s:.1f} s after); "
                f"checkpoints {saved}, last verifies: {problem or 'yes'}; relaunch exit {code2}, resumed from step "
                f"{found.group(1) if found else None}, steps {steps}, orphans {len(orphans2)}")
    ok = (exits[0] in ("1", "5") and bool(lost or watch) and not orphans and not orphans2 and problem is None
          and complete)
    return _verdict("ep_rank_sigkill", "rank 1 SIGKILLed: rank 0 exits 1 with the 'lost its connection' line (or 5), "
                    "no process left, the last checkpoint verifies, the relaunch finishes every step", observed, ok,
                    (problem is None and complete, "checkpoint intact; every step logged once after the relaunch"),
                    orphans=len(orphans) + len(orphans2), seconds_to_exit=round(took, 1))


def _ep_group_sigterm(name: str, wait_for: str) -> Callable:
    return lambda h, work, data: ep_group_sigterm(h, work, name, wait_for)


def ep_group_sigterm(h, work: Path, name: str, wait_for: str) -> dict:
    """wait_for "step 2 logged": the signal comes during the first save (the results Manager is being started);
    "checkpoint 2 saved": after it."""
    base = _fresh(work / name)
    run_dir = base / "run"
    overrides = _ep_overrides(work, run_dir)
    seen: set = set()
    proc = _torchrun(base, overrides, "signalled")
    _track(proc, seen, lambda: len(h.metrics(run_dir)) >= 2 if wait_for == "step 2 logged" else
           (run_dir / "checkpoints" / "step_00000002").exists())
    os.killpg(proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    code, orphans, gone_s = _finish(proc, seen)
    took = time.monotonic() - t0
    log = (base / "signalled.log").read_text(errors="replace")
    said = next((x for x in log.splitlines() if "exgrpo-train: preempted" in x), "")
    exits = _exits(base, "signalled")
    logged = [r["step"] for r in h.metrics(run_dir)]
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    code2, orphans2, steps = _run_to_end(h, base, overrides, "requeued")
    complete = code2 == 0 and steps == list(range(1, EP_STEPS + 1))
    ref = work / "ep_reference" / "run"
    same = None
    if h.metrics(ref):
        same = [_comparable(r) for r in h.metrics(run_dir)] == [_comparable(r) for r in h.metrics(ref)]
    observed = (f"torchrun exit {code} {took:.0f} s after the SIGTERM; rank exits {exits}; message: "
                f"{said.strip()[:300]!r}; logged {logged}, checkpoints {saved}; processes seen {len(seen)}, alive "
                f"15 s after torchrun {len(orphans)} (last gone {gone_s:.1f} s after); requeued run exit {code2}, "
                f"steps {steps}, orphans {len(orphans2)}; metrics equal to the uninterrupted run: {same}")
    ok = (exits == {0: "75", 1: "75"} and bool(logged) and f"step_{logged[-1]:08d}" in saved and not orphans
          and not orphans2 and complete and same is not False)
    return _verdict(name, f"SIGTERM to torchrun's group once {wait_for}: each rank saves and exits 75, "
                    "no process left; "
                    "the requeued run finishes every step once, metrics equal to the uninterrupted run", observed, ok,
                    (complete and same is not False, "every step logged once; metrics (all but timings) equal to "
                     f"ep_reference: {same}"), orphans=len(orphans) + len(orphans2), seconds_to_exit=round(took, 1))


SCENARIOS: dict[str, Callable] = {"ep_reference": ep_reference, "ep_rank_sigkill": ep_rank_sigkill,
                                  "ep_group_sigterm": _ep_group_sigterm("ep_group_sigterm", "step 2 logged"),
                                  "ep_group_sigterm_after_save": _ep_group_sigterm("ep_group_sigterm_after_save",
                                                                                   "checkpoint 2 saved")}
