"""Every way a multi-rank run stops says why, on the rank that stops:

* a preemption signal that reaches only rank 1 stops both ranks after the same step with exit 75, and rank 0 says
  so: which signal, that another rank received it, the step saved, the requeue exit code;
* a rank that dies (SIGKILL) shows up on the survivor as a message naming the lost peer and what to do, not as
  gloo's raw "Connection closed by peer" traceback.

Two real ranks (DP=2, each with its own share of the step's groups) of `python -m exgrpo_megatron.train`.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_stop_messages.py -x
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from exgrpo_megatron.distributed.launch_env import free_local_port
from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE
from tests.helpers.rank_processes import log_tail, reap, start_rank_process
from tests.test_trainer_resume import _overrides, _write_dataset

TIMEOUT_S = 300


def _start_two_ranks(tmp_path: Path, total_steps: int) -> tuple[list, Path]:
    data = _write_dataset(tmp_path / "train.jsonl")
    run_dir = tmp_path / "run"
    overrides = [*_overrides(data, total_steps, extra=("checkpoint.save_every=100",)), f"logging.run_dir={run_dir}"]
    port = free_local_port()
    procs = [start_rank_process(["-m", "exgrpo_megatron.train", *overrides], tmp_path / f"rank{rank}.log", rank, 2,
                                port) for rank in range(2)]
    return procs, run_dir


def _wait_for_first_step(procs: list, run_dir: Path) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + TIMEOUT_S
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.time() < deadline and all(p.poll() is None for p in procs), log_tail(procs)
        time.sleep(0.05)


def test_a_signal_to_one_rank_stops_both_with_75_and_rank_0_says_why(tmp_path):
    procs, run_dir = _start_two_ranks(tmp_path, total_steps=40)
    try:
        _wait_for_first_step(procs, run_dir)
        os.kill(procs[1].pid, signal.SIGUSR1)
    finally:
        codes = [reap(p, TIMEOUT_S) for p in procs]
    assert codes == [REQUEUE_EXIT_CODE] * 2, log_tail(procs)
    rank0 = procs[0].log_path.read_text()
    # old code: exit 75 and not a word about it
    assert "exgrpo-train: preempted: SIGUSR1 received (by another rank); saved step " in rank0, rank0[-3000:]
    assert f"exiting with {REQUEUE_EXIT_CODE} to be requeued" in rank0


def test_a_dead_rank_is_named_on_the_survivor_without_a_traceback(tmp_path):
    procs, run_dir = _start_two_ranks(tmp_path, total_steps=40)
    try:
        _wait_for_first_step(procs, run_dir)
        os.kill(procs[1].pid, signal.SIGKILL)
        code = reap(procs[0], TIMEOUT_S)
    finally:
        reap(procs[1], 10)
    survivor = procs[0].log_path.read_text()
    assert code == 1, survivor[-3000:]
    # old code: gloo's "Connection closed by peer" traceback and nothing else
    assert "Traceback" not in survivor, survivor[-3000:]
    assert "exgrpo-train: rank 0 lost its connection to rank 1 (Connection " in survivor, survivor[-3000:]
    assert "relaunch" in survivor and "checkpoint.resume=auto" in survivor
