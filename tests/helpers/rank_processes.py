"""Worker scripts run as real OS processes, one per rank (for tests that kill or signal them).

    proc = start_rank_process(["-m", "tests.my_worker", arg], log_path, rank=0, world=1, port=free_local_port())
    assert reap(proc, timeout=400) == 0, log_tail([proc])

Each process runs in its own session with its output in a file (a pipe would be held open by the
multiprocessing helpers dist_checkpointing starts, which outlive a SIGKILLed parent); `reap` waits
for it and then kills whatever it left behind in that session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The torch.distributed launch variables of one rank on this host, one intra-op thread."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "LOCAL_WORLD_SIZE": str(world)}


def start_rank_process(python_args: list[str], log_path: Path, rank: int, world: int, port: int) -> subprocess.Popen:
    """`python <python_args>` from the repo root as `rank` of `world`; the log path is kept as `proc.log_path`."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *python_args], cwd=REPO, env=os.environ | rank_env(rank, world, port),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log_path
    return proc


def reap(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for the process, then kill what it left behind in its session; returns its exit code."""
    try:
        code = proc.wait(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return code


def log_tail(procs: list[subprocess.Popen], chars: int = 4000) -> str:
    return "\n".join(p.log_path.read_text()[-chars:] for p in procs)
