"""Process-fault scenarios for bench/fault_trials.py (`--scenarios`): one of a run's processes dies, stops or is
signalled, or an input is unusable. Each reports what it expected and observed, whether nothing was lost, and the
orphans: the processes of the run's session (the trainer leads it) still alive after the trainer exited.

trainer_killed_in_save   megatron's forked writer of checkpoint 4 SIGKILLs the trainer and goes on writing -> the
                         writer dies with it, a relaunch at once is not refused (the lock is free), resumes from 2 and
                         ends bitwise
group_sigterm            max_staleness=1: SIGTERM to the whole process group after step 3 (Slurm at the time limit)
group_sigusr1            -> the generator ignores it, the trainer saves and exits 75; the requeued run ends bitwise
generator_sigstop        max_staleness=1: the generator stopped after step 3 -> named as stopped past its deadline,
                         the last whole step saved, exit 4; the relaunch asks again for the rollouts in flight and
                         finishes (every step logged once; rollouts regenerated from newer weights, so not bitwise)
generator_sigkill        the same with the generator SIGKILLed -> named as killed by SIGKILL, exit 4, relaunch finishes
stopped_generator_sigterm  max_staleness=1: the generator stopped after step 3, then SIGTERM / SIGUSR1 to the group ->
stopped_generator_sigusr1  exit 75 within seconds (not at the generator's deadline) naming the stopped generator, the
                         last whole step saved; the requeued run finishes every step (lost rollouts regenerated)
disk_nearly_full         the run dir on a 200 KiB tmpfs (needs root) -> exit 2 before step 1 naming logging.run_dir, the
                         space needed and free; no run directory left behind
parquet_empty            a 0-byte / garbage / answer-column-less .parquet as data.train_files -> exit 2 naming the
parquet_garbage          file, no checkpoint written
parquet_no_answer
busy_port                an exported MASTER_PORT another process listens on, plain `python` -> exit 2 naming the port
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.reliability_trials import (
    RUN_TIMEOUT_S,
    _fresh,
    _log,
    _verdict,
    checkpoint_problem,
    orphans_within,
    run_processes,
)
from tests.test_generate_ahead import AHEAD
from tests.test_generator_faults import FAST_DEADLINE, wait_for_survivors
from tests.test_trainer_resume import N_STEPS, _overrides

REPO = Path(__file__).resolve().parents[1]
IS_METRICS = ("rollout/staleness", "mismatch/token_mult_prob_error", "rollout/is_weight_mean")
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


def _wait_logged(h, run_dir: Path, proc: subprocess.Popen, steps: int) -> None:
    while proc.poll() is None and len(h.metrics(run_dir)) < steps:
        time.sleep(0.05)


def _exit_and_orphans(proc: subprocess.Popen) -> tuple[int, list[int], list[int]]:
    """Exit code, the session's processes alive at the trainer's exit, and those still alive 15 s later."""
    code = proc.wait(timeout=RUN_TIMEOUT_S)
    from tests.test_generator_faults import session_survivors

    at_exit = session_survivors(proc.pid)
    later = wait_for_survivors(proc.pid, 15.0)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the bench leaves nothing behind either way
    except ProcessLookupError:
        pass
    return code, at_exit, later


def _ahead_reference(h, work: Path, data: str) -> Path:
    """The uninterrupted run generating one step ahead (once; kept in the work dir)."""
    (work / "ahead").mkdir(parents=True, exist_ok=True)
    h.reference(work / "ahead", data, work / "ahead" / "init", AHEAD)
    return work / "ahead" / "reference"


def trainer_killed_in_save(h, work: Path, data: str) -> dict:
    run_dir = _fresh(work / "trainer_killed_in_save")
    overrides = _overrides(data, N_STEPS)
    make_init = ("--make-init", str(run_dir / "init"))
    proc = h.launch(run_dir, overrides, "killed", (*make_init, "--kill-trainer-from-writer", "4"))
    code, at_exit, orphans = _exit_and_orphans(proc)
    t0 = time.perf_counter()
    resumed = h.launch(run_dir, overrides, "resumed", make_init)  # at once: before the old code's writer let go
    code2 = h.reap(resumed, RUN_TIMEOUT_S)
    log2 = _log(run_dir, "resumed")
    found = re.search(r"resumed from \S+ at step (\d+)", log2)
    lost = h.same_final_state(run_dir, work / "reference", run_dir) if code2 == 0 else (False, f"exit {code2}")
    observed = (f"trainer exit {code}; session processes at its exit {len(at_exit)}, 15 s later {len(orphans)}; "
                f"relaunch exit {code2} after {time.perf_counter() - t0:.0f} s, refused as in use: "
                f"{'in use by another trainer' in log2}, resumed from step {found.group(1) if found else None}")
    ok = code == -signal.SIGKILL and code2 == 0 and not orphans and found is not None and found.group(1) == "2"
    return _verdict("trainer_killed_in_save", "trainer -9 while its writer lives; no orphan; the relaunch resumes "
                    "from 2 at once and ends bitwise", observed, ok, lost, orphans=len(orphans))


def _group_signal(sig: signal.Signals) -> Callable:
    def scenario(h, work: Path, data: str) -> dict:
        ref = _ahead_reference(h, work, data)
        name = f"group_{sig.name.lower()}"
        run_dir = _fresh(work / name)
        overrides = _overrides(data, N_STEPS, extra=AHEAD)
        make_init = ("--make-init", str(run_dir / "init"))
        proc = h.launch(run_dir, overrides, "signalled", make_init)
        _wait_logged(h, run_dir, proc, 3)
        os.killpg(proc.pid, sig)
        code, _at_exit, orphans = _exit_and_orphans(proc)
        log = _log(run_dir, "signalled")
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        code2 = h.reap(h.launch(run_dir, overrides, "requeued", make_init), RUN_TIMEOUT_S)
        lost = h.same_final_state(run_dir, ref, run_dir) if code2 == 0 else (False, f"exit {code2}")
        failed = "the generator failed" in log or "the generator process (pid" in log
        observed = (f"exit {code}, checkpoints {saved}, generator reported failed: {failed}; orphans {len(orphans)}; "
                    f"requeued run exit {code2}")
        return _verdict(name, f"{sig.name} to the process group after step 3 -> preemption save, exit 75, no orphan; "
                        "the requeued run ends bitwise", observed, code == 75 and bool(saved) and not orphans and
                        code2 == 0, lost, orphans=len(orphans))
    return scenario


def _generator_fault(sig: signal.Signals, said: str) -> Callable:
    def scenario(h, work: Path, data: str) -> dict:
        name = f"generator_{sig.name.lower()}"
        run_dir = _fresh(work / name)
        overrides = _overrides(data, N_STEPS, extra=(*AHEAD, *FAST_DEADLINE))
        make_init = ("--make-init", str(run_dir / "init"))
        proc = h.launch(run_dir, overrides, "failed", make_init)
        _wait_logged(h, run_dir, proc, 3)
        found = re.search(r"generator process started \(pid (\d+)\)", _log(run_dir, "failed"))
        assert found, _log(run_dir, "failed")[-2000:]
        os.kill(int(found.group(1)), sig)
        t0 = time.perf_counter()
        code, _at_exit, orphans = _exit_and_orphans(proc)
        took = time.perf_counter() - t0
        log = _log(run_dir, "failed")
        line = next((x for x in log.splitlines() if "the generator process (pid" in x), "")
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        logged = [r["step"] for r in h.metrics(run_dir)]
        code2 = h.reap(h.launch(run_dir, overrides, "relaunched", make_init), RUN_TIMEOUT_S)
        rows = {r["step"]: r for r in h.metrics(run_dir)}
        steps = [r["step"] for r in h.metrics(run_dir)]
        complete = code2 == 0 and steps == list(range(1, N_STEPS + 1))
        is_check = {f"step {s} ({kind})": {k: rows.get(s, {}).get(k) for k in IS_METRICS}
                    for s, kind in ((logged[-1], "before the fault"), (logged[-1] + 1, "regenerated"))}
        regen = rows.get(logged[-1] + 1, {})
        is_right = (regen.get("rollout/staleness") == 0.0
                    and abs(regen.get("mismatch/token_mult_prob_error", 0.0) - 1.0) < 1e-5
                    and abs(regen.get("rollout/is_weight_mean", 0.0) - 1.0) < 1e-5)
        observed = (f"exit {code} {took:.0f} s after the signal; message: {line.strip()[:300]}; logged {logged}, "
                    f"checkpoints {saved}; orphans {len(orphans)}; relaunch exit {code2}, steps logged {steps}; "
                    f"IS: {is_check}")
        ok = code == 4 and said in line and f"step_{logged[-1]:08d}" in saved and not orphans and complete and is_right
        return _verdict(name, f"named ({said}), last whole step saved, exit 4, no orphan; the relaunch finishes "
                        "every step, the regenerated step logs rollout/staleness 0 and mismatch/token_mult_prob_error "
                        "and rollout/is_weight_mean 1 (within 1e-5)", observed, ok,
                        (complete, "every step logged once; the lost rollouts were regenerated (not bitwise by "
                                   "design)"), orphans=len(orphans), seconds_to_exit=round(took, 1), is_check=is_check)
    return scenario


def _stopped_generator_signal(sig: signal.Signals) -> Callable:
    def scenario(h, work: Path, data: str) -> dict:
        name = f"stopped_generator_{sig.name.lower()}"
        run_dir = _fresh(work / name)
        overrides = _overrides(data, N_STEPS, extra=(*AHEAD, "rollout.generator.deadline_min_seconds=600"))
        make_init = ("--make-init", str(run_dir / "init"))
        proc = h.launch(run_dir, overrides, "signalled", make_init)
        _wait_logged(h, run_dir, proc, 3)
        found = re.search(r"generator process started \(pid (\d+)\)", _log(run_dir, "signalled"))
        assert found, _log(run_dir, "signalled")[-2000:]
        os.kill(int(found.group(1)), signal.SIGSTOP)
        time.sleep(1.5)
        os.killpg(proc.pid, sig)
        t0 = time.perf_counter()
        code, _at_exit, orphans = _exit_and_orphans(proc)
        took = time.perf_counter() - t0
        line = next((x for x in _log(run_dir, "signalled").splitlines() if "exgrpo-train: preempted:" in x), "")
        logged = [r["step"] for r in h.metrics(run_dir)]
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        code2 = h.reap(h.launch(run_dir, overrides, "requeued", make_init), RUN_TIMEOUT_S)
        steps = [r["step"] for r in h.metrics(run_dir)]
        complete = code2 == 0 and steps == list(range(1, N_STEPS + 1))
        observed = (f"exit {code} {took:.0f} s after the signal; message: {line.strip()[:300]}; logged {logged}, "
                    f"checkpoints {saved}; orphans {len(orphans)}; requeued run exit {code2}, steps logged {steps}")
        ok = (code == 75 and took < 30 and "is stopped" in line and bool(logged) and f"step_{logged[-1]:08d}" in saved
              and not orphans and complete)
        return _verdict(name, f"{sig.name} to the group while the generator is stopped -> exit 75 within 30 s naming "
                        "it, the last whole step saved, no orphan; the requeued run finishes every step", observed,
                        ok, (complete, "every step logged once; the lost rollouts were regenerated (not bitwise)"),
                        orphans=len(orphans), seconds_to_exit=round(took, 1))
    return scenario


def _trainer_death(sig: signal.Signals) -> Callable:
    def scenario(h, work: Path, data: str) -> dict:
        name = f"trainer_{sig.name.lower()}_with_helpers"
        run_dir = _fresh(work / name)
        proc = h.launch(run_dir, _overrides(data, N_STEPS), "killed", ("--make-init", str(run_dir / "init")))
        _wait_logged(h, run_dir, proc, 3)  # checkpoint 2 saved: the results Manager lives, as the grader pool
        seen = run_processes(proc.pid)
        kinds = sorted(_kind(pid) for pid, _ in seen if pid != proc.pid)
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=RUN_TIMEOUT_S)
        orphans, gone_s = orphans_within(seen, [proc.pid], 15.0)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        problem = checkpoint_problem(run_dir / "checkpoints" / saved[-1]) if saved else "no checkpoint"
        observed = (f"trainer exit {code}; its helpers at the {sig.name}: {kinds}; alive 15 s later: {len(orphans)}, "
                    f"the last gone {gone_s:.1f} s after the trainer's exit; checkpoints {saved}, the last verifies: "
                    f"{problem or 'yes'}")
        ok = code == -sig and "results Manager" in kinds and not orphans and gone_s < 5 and problem is None
        return _verdict(name, f"the trainer {sig.name}ed while its results Manager and grader pool live -> every "
                        "process of the run gone within 5 s, the last checkpoint intact", observed, ok,
                        (problem is None, "the last checkpoint verifies"), orphans=len(orphans),
                        seconds_to_last_gone=round(gone_s, 1))
    return scenario


def _kind(pid: int) -> str:
    try:
        cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return "gone"
    for marker, kind in (("forkserver", "grader fork server or worker"), ("resource_tracker", "resource tracker"),
                         ("spawn_main", "results Manager"), ("generator", "generator")):
        if marker in cmd:
            return kind
    return f"forked child ({cmd[:40]})"


def disk_nearly_full(h, work: Path, data: str) -> dict:
    mount_point = _fresh(work / "disk_nearly_full")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount_point)],
                             capture_output=True).returncode == 0
    if not mounted:
        return _verdict("disk_nearly_full", "exit 2 before step 1", "not run: mounting a tmpfs needs root", False,
                        (True, "nothing started"), orphans=0)
    try:
        run_dir = mount_point / "run"
        with open(work / "disk_nearly_full.log", "w") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "exgrpo_megatron.train", *_overrides(data, N_STEPS),
                                     f"logging.run_dir={run_dir}"], cwd=REPO, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS})
        code, _at_exit, orphans = _exit_and_orphans(proc)
        log = (work / "disk_nearly_full.log").read_text(errors="replace")
        named = f"logging.run_dir: {run_dir}" in log and "needs about" in log and "free on the filesystem" in log
        left = run_dir.exists()
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
    observed = (f"exit {code}, key, space needed and free named: {named}, traceback: {'Traceback' in log}, "
                f"run directory left: {left}")
    return _verdict("disk_nearly_full", "exit 2 before step 1 naming logging.run_dir, the space needed and free; "
                    "nothing left behind", observed, code == 2 and named and "Traceback" not in log and not left,
                    (True, "nothing started"), orphans=len(orphans))


def _bad_parquet(kind: str) -> Callable:
    def scenario(h, work: Path, data: str) -> dict:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = f"parquet_{kind}"
        run_dir = _fresh(work / name)
        path = run_dir / f"{kind}.parquet"
        if kind == "empty":
            path.write_bytes(b"")
        elif kind == "garbage":
            path.write_bytes(os.urandom(4096))
        else:
            pq.write_table(pa.table({"prompt": ["What is 1+1?"], "solution": ["2"]}), path)
        proc = h.launch(run_dir / "run", _overrides(str(path), N_STEPS), "run")
        code, _at_exit, orphans = _exit_and_orphans(proc)
        log = _log(run_dir / "run", "run")
        named = str(path) in log
        wrote = (run_dir / "run" / "checkpoints").exists()
        observed = f"exit {code}, file named: {named}, traceback: {'Traceback' in log}, checkpoints written: {wrote}"
        return _verdict(name, "exit 2 naming the file, nothing written", observed,
                        code == 2 and named and "Traceback" not in log and not wrote, (not wrote, "nothing to lose"),
                        orphans=len(orphans))
    return scenario


def busy_port(h, work: Path, data: str) -> dict:
    run_dir = _fresh(work / "busy_port")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS} | {"OMP_NUM_THREADS": "1"}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with open(run_dir / "run.log", "w") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "tests.trainer_resume_worker", str(run_dir / "run"), "--",
                                     *_overrides(data, N_STEPS)], cwd=REPO, env=env | {"MASTER_PORT": str(port)},
                                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        code, _at_exit, orphans = _exit_and_orphans(proc)
    log = (run_dir / "run.log").read_text(errors="replace")
    named = f"MASTER_PORT: {port}" in log
    observed = f"exit {code}, port named: {named}, how to free it: {'ss -ltnp' in log}, traceback: {'Traceback' in log}"
    return _verdict("busy_port", "exit 2 naming the port and how to free or change it", observed,
                    code == 2 and named and "Traceback" not in log, (True, "nothing started"), orphans=len(orphans))


SCENARIOS: dict[str, Callable] = {
    "trainer_killed_in_save": trainer_killed_in_save,
    "group_sigterm": _group_signal(signal.SIGTERM), "group_sigusr1": _group_signal(signal.SIGUSR1),
    "generator_sigstop": _generator_fault(signal.SIGSTOP, "is stopped (SIGSTOP"),
    "generator_sigkill": _generator_fault(signal.SIGKILL, "died (killed by SIGKILL)"),
    "parquet_empty": _bad_parquet("empty"), "parquet_garbage": _bad_parquet("garbage"),
    "parquet_no_answer": _bad_parquet("no_answer"), "busy_port": busy_port,
    "stopped_generator_sigterm": _stopped_generator_signal(signal.SIGTERM),
    "stopped_generator_sigusr1": _stopped_generator_signal(signal.SIGUSR1), "disk_nearly_full": disk_nearly_full,
    "trainer_sigkill_with_helpers": _trainer_death(signal.SIGKILL),
    "trainer_sigabrt_with_helpers": _trainer_death(signal.SIGABRT),
}
