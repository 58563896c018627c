"""No process of a run outlives its trainer, and none keeps the run directory locked after the trainer is gone.

A trainer-like process (real `acquire_run_dir`, real forks through multiprocessing's 'fork' context as megatron-core's
checkpoint writers are started) is SIGKILLed while its forked child sleeps:

* the run directory can be locked again at once, although the child still lives;
* with the trainer's fork hooks installed (init_distributed installs them), the child dies with the trainer;
* the checkpoint writers' results Manager (spawned, ignores SIGTERM / SIGUSR1), started by the real
  `ensure_signal_proof_save_workers`, dies with its trainer killed by SIGKILL or SIGABRT -- also when the Manager's
  own threads cannot run (it is stopped: only the kernel can end it then);
* the grader pool's fork server and its worker die with their trainer (SIGKILL), also a worker that is stopped (it
  cannot read the end of its pipe).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_process_lifetime.py -x
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exgrpo_megatron.distributed.run_lock import LOCK_FILE, acquire_run_dir

REPO = Path(__file__).resolve().parents[1]
TRAINER = """
import multiprocessing as mp, sys, time
from exgrpo_megatron.distributed.run_lock import acquire_run_dir
lock = acquire_run_dir(sys.argv[1])
if sys.argv[2] == "hooks":
    from exgrpo_megatron.distributed.lifetime import install_fork_hooks
    install_fork_hooks()
writer = mp.get_context("fork").Process(target=time.sleep, args=(120,))  # as megatron's checkpoint writer
writer.start()
print(writer.pid, flush=True)
time.sleep(120)
"""

TRAINER_WITH_MANAGER = """
import time
from exgrpo_megatron.checkpoint import model_state
model_state.ensure_signal_proof_save_workers()
print(model_state._RESULTS_MANAGER._process.pid, flush=True)
time.sleep(120)
"""

TRAINER_WITH_GRADER = """
import multiprocessing.forkserver as fs, time
from exgrpo_megatron.reward.grader import GraderPool
pool = GraderPool(num_workers=1)
pool.wait_ready()  # the worker has run its after-fork hooks (it is stopped below, so it must have armed them)
print(pool._workers[0].process.pid, fs._forkserver._forkserver_pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"  # a zombie has died (its parent reaps it)
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float) -> None:
    """Until none of `pids` is alive, for at most `seconds` (the caller asserts what it expects)."""
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _open_files(pid: int) -> set[str]:
    try:
        return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except FileNotFoundError:
        return set()


def _trainer_with_a_forked_writer(run_dir: Path, hooks: bool) -> tuple[subprocess.Popen, int]:
    """The trainer and its forked writer, once the writer has run its after-fork hooks (closed its copy of the
    lock's descriptor: until the child is first scheduled, it still holds the copy fork gave it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(run_dir), "hooks" if hooks else "plain"],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    writer = int(proc.stdout.readline())
    deadline = time.monotonic() + 30
    while str(run_dir / LOCK_FILE) in _open_files(writer) and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc, writer


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_the_lock_is_free_at_once_after_kill_9_of_the_trainer_while_its_forked_writer_lives(tmp_path):
    trainer, writer = _trainer_with_a_forked_writer(tmp_path / "run", hooks=False)
    try:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        assert _alive(writer), "the writer should outlive the trainer here (no fork hooks)"
        lock = acquire_run_dir(tmp_path / "run")  # old code: RunDirError naming the dead trainer's pid
        lock.release()
    finally:
        _kill(writer)


def test_forked_children_die_with_the_trainer(tmp_path):
    trainer, writer = _trainer_with_a_forked_writer(tmp_path / "run", hooks=True)
    try:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        _wait_gone([writer], 10)
        assert not _alive(writer), f"the forked writer {writer} outlived its trainer"
    finally:
        _kill(writer)


def test_without_file_locks_a_recorded_holder_whose_pid_was_reused_is_stale(tmp_path):
    """Filesystems without flock: the recorded pid alone would call a reused pid's new process the holder."""
    import json
    import socket

    import pytest

    from exgrpo_megatron.distributed.run_lock import RunDirError, _claim_without_flock, _process_start

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = tmp_path / "run.lock"
        live = {"pid": other.pid, "host": socket.gethostname(), "pid_start": _process_start(other.pid)}
        path.write_text(json.dumps(live))
        with open(path, "a+", encoding="utf-8") as fh, pytest.raises(RunDirError, match=f"pid {other.pid}"):
            _claim_without_flock(fh, path)
        path.write_text(json.dumps(live | {"pid_start": live["pid_start"] - 1}))  # that pid, another process
        with open(path, "a+", encoding="utf-8") as fh:
            _claim_without_flock(fh, path)  # old code: refused, the pid being alive
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("death", [signal.SIGKILL, signal.SIGABRT])
@pytest.mark.parametrize("manager_stopped", [False, True])
def test_the_checkpoint_results_manager_dies_with_its_trainer(death, manager_stopped):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_WITH_MANAGER], stdout=subprocess.PIPE, text=True, env=env)
    assert trainer.stdout is not None
    manager = int(trainer.stdout.readline())
    try:
        if manager_stopped:
            os.kill(manager, signal.SIGSTOP)  # its threads cannot run (as when stuck): no polling can notice
        trainer.send_signal(death)
        trainer.wait(timeout=30)
        _wait_gone([manager], 5)
        # old code, stopped: a thread polling the parent pid, which never runs; the Manager lives on
        assert not _alive(manager), f"the results Manager {manager} outlived its trainer ({death.name})"
    finally:
        _kill(manager)


def test_the_grader_fork_server_and_a_stopped_worker_die_with_their_trainer():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_WITH_GRADER], stdout=subprocess.PIPE, text=True, env=env)
    assert trainer.stdout is not None
    worker, server = (int(x) for x in trainer.stdout.readline().split())
    try:
        os.kill(worker, signal.SIGSTOP)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        _wait_gone([worker, server], 5)
        # old code: the server exits (its pipe closed), the stopped worker lives on
        assert not _alive(server) and not _alive(worker), (server, _alive(server), worker, _alive(worker))
    finally:
        _kill(worker)
        _kill(server)
