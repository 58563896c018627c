"""A run generating ahead (`rollout.max_staleness` = 1) when its generator process is signalled, stopped or killed,
through the real training loop (tests/trainer_resume_worker.py, the tiny run of tests/test_trainer_resume.py):

* a SIGTERM to the whole process group (what Slurm sends) during training: the generator ignores it, the trainer
  finishes the step, saves, and exits 75;
* SIGTERM or SIGUSR1 to the group while the generator is stopped (the trainer waits for it): exit 75 within seconds,
  not at the generator's deadline, with the last whole step saved and the rollouts not received marked lost;
* the generator stopped (SIGSTOP): named as stopped once it misses its deadline (10 s here: the deadline scales
  with the measured rounds), the last whole step saved with the lost rollouts marked, exit 4;
* the relaunch resumes, asks again for those rollouts (from the saved weights) and trains on them with importance
  weights and a mismatch metric of that policy (staleness 0, pi_behaviour = pi_old); its generator killed (SIGKILL):
  named as killed by SIGKILL, the last whole step saved, exit 4.

After each, no process of the run's session outlives the trainer.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_generator_faults.py -x
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE
from exgrpo_megatron.training.async_generation.watch import EXIT_GENERATOR_FAILED
from tests.test_generate_ahead import AHEAD
from tests.test_trainer_resume import _launch, _overrides, _write_dataset

RUN_TIMEOUT_S = 300
FAST_DEADLINE = ("rollout.generator.deadline_min_seconds=10", "rollout.generator.deadline_factor=5")


def session_survivors(session: int) -> list[int]:
    """Live processes (zombies excluded) of the session `session`, which the launched trainer leads."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def wait_for_survivors(session: int, seconds: float = 15.0) -> list[int]:
    """The session's processes still alive `seconds` after its leader exited (helpers get that long to exit)."""
    end = time.monotonic() + seconds
    while (left := session_survivors(session)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def generator_pid(log_path: Path, proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        found = re.search(r"generator process started \(pid (\d+)\)", log_path.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"no generator pid in {log_path}:\n{log_path.read_text()[-3000:]}")


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = RUN_TIMEOUT_S) -> None:
    end = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < end and proc.poll() is None:
        if path.exists() and sum(1 for line in path.read_text().splitlines() if line.strip()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged:\n{proc.log_path.read_text()[-3000:]}")  # type: ignore[attr-defined]


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> tuple[int, list[int]]:
    """The trainer's exit code and the processes of its session still alive afterwards; then nothing is left."""
    try:
        code = proc.wait(timeout=timeout)
        survivors = wait_for_survivors(proc.pid)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return code, survivors


def _run(tmp_path: Path, total_steps: int, *extra: str, tag: str = "run") -> tuple[Path, subprocess.Popen]:
    data = _write_dataset(tmp_path / "train.jsonl") if not (tmp_path / "train.jsonl").exists() else \
        str(tmp_path / "train.jsonl")
    run_dir = tmp_path / "run"
    overrides = _overrides(data, total_steps, extra=(*AHEAD, "checkpoint.save_every=100", *extra))
    (proc,) = _launch(run_dir, overrides, worker_args=("--make-init", str(tmp_path / "init")), tag=tag)
    return run_dir, proc


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def test_a_group_sigterm_saves_and_exits_75(tmp_path):
    run_dir, proc = _run(tmp_path, 40)
    wait_for_step(run_dir, proc, 2)
    os.killpg(proc.pid, signal.SIGTERM)  # the trainer, its generator, graders, checkpoint helpers: all of them
    code, survivors = finish(proc)
    log = proc.log_path.read_text()
    assert code == REQUEUE_EXIT_CODE, log[-4000:]  # old code: the generator died of it, "the generator failed", 1
    assert _checkpoints(run_dir), log[-4000:]
    assert survivors == [], survivors


@pytest.mark.parametrize(("preemption", "save_every"), [(signal.SIGTERM, 100), (signal.SIGUSR1, 1)])
def test_a_group_signal_while_the_generator_is_stopped_exits_75_at_once(tmp_path, preemption, save_every):
    """save_every=1: the signal may reach the trainer while a step's regular save waits for the generator."""
    run_dir, proc = _run(tmp_path, 40, "rollout.generator.deadline_min_seconds=600",  # the deadline: far away
                         f"checkpoint.save_every={save_every}")
    pid = generator_pid(proc.log_path, proc)  # type: ignore[attr-defined]
    wait_for_step(run_dir, proc, 2)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(1.5)  # the trainer is now waiting for the next step's rollouts (or trains a step it has them for)
    os.killpg(proc.pid, preemption)
    started = time.monotonic()
    code, survivors = finish(proc, timeout=120)  # old code: waits for the 600 s deadline, then exit 4
    took = time.monotonic() - started
    log = proc.log_path.read_text()  # type: ignore[attr-defined]
    assert code == REQUEUE_EXIT_CODE, log[-4000:]
    assert took < 30, took
    step = _last_logged(run_dir)
    assert _checkpoints(run_dir)[-1] == f"step_{step:08d}"  # the last whole step
    assert f"exgrpo-train: preempted: {preemption.name} received (by this rank)" in log, log[-3000:]
    assert f"saved step {step}" in log and f"(pid {pid}) is stopped" in log, log[-3000:]
    state = json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "state" / "trainer_state.json").read_text())
    assert None in [e["result"] for e in state["ahead"]["in_flight"]]  # what the stopped generator held
    assert survivors == [], survivors


def _fail_the_generator(tmp_path: Path, sig: signal.Signals, after_step: int, tag: str) -> tuple[Path, str]:
    """Launch (or relaunch) the run, signal its generator once `after_step` steps are logged, expect exit 4."""
    run_dir, proc = _run(tmp_path, 40, *FAST_DEADLINE, tag=tag)
    pid = generator_pid(proc.log_path, proc)  # type: ignore[attr-defined]
    wait_for_step(run_dir, proc, after_step)
    os.kill(pid, sig)
    started = time.monotonic()
    code, survivors = finish(proc, timeout=120)  # old code, SIGSTOP: waits for hours
    took = time.monotonic() - started
    log = proc.log_path.read_text()  # type: ignore[attr-defined]
    assert code == EXIT_GENERATOR_FAILED, log[-4000:]  # old code, SIGKILL: a traceback, exit 1
    assert f"the generator process (pid {pid})" in log, log[-4000:]
    assert survivors == [], survivors
    assert took < 90, took
    return run_dir, log


def _last_logged(run_dir: Path) -> int:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]


def test_a_stopped_then_a_killed_generator_are_named_and_the_relaunch_asks_again(tmp_path):
    run_dir, log = _fail_the_generator(tmp_path, signal.SIGSTOP, 2, "stopped")
    assert "is stopped (SIGSTOP" in log and "rollout.generator.deadline_factor=5" in log, log[-3000:]
    step = _last_logged(run_dir)
    assert _checkpoints(run_dir) == [f"step_{step:08d}"]  # the last whole step
    state = json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "state" / "trainer_state.json").read_text())
    assert [e["result"] for e in state["ahead"]["in_flight"]] == [None]  # the rollouts the generator held

    run_dir, log = _fail_the_generator(tmp_path, signal.SIGKILL, step + 1, "killed")  # trained on them, asked again
    assert f"at step {step}" in log and "died (killed by SIGKILL)" in log, log[-3000:]
    assert _last_logged(run_dir) > step
    # The lost step's rollouts were generated again from the saved weights, which are also its pi_old: staleness 0,
    # and the importance correction and the mismatch metric see the policy that generated them (pi_behaviour =
    # pi_old up to rounding), where the steps before the failure, one update stale, did not.
    rows = {json.loads(line)["step"]: json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    regenerated, stale = rows[step + 1], rows[step]
    assert regenerated["rollout/staleness"] == 0.0 and stale["rollout/staleness"] == 1.0
    assert abs(regenerated["mismatch/token_mult_prob_error"] - 1.0) < 1e-5, regenerated
    assert abs(regenerated["rollout/is_weight_mean"] - 1.0) < 1e-5, regenerated
    assert stale["mismatch/token_mult_prob_error"] > 1.0 + 1e-4, stale
