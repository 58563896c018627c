"""A bench run's training process (bench/exgrpo_vs_grpo.py): started in its own session, so that stopping the bench
stops every process of its runs -- the bash line, the trainer and what the trainer started -- instead of leaving them
training unattended."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import IO


def start_run(script: str, cwd: str, env: dict[str, str], log: IO) -> subprocess.Popen:
    """`bash -c script` as the leader of a new process group (its pid is the group's id)."""
    return subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_runs(procs: Iterable[subprocess.Popen], grace_s: float = 120.0) -> None:
    """SIGTERM to each run's whole process group (the trainer saves a checkpoint on it and exits: the run resumes
    where it stopped), then SIGKILL to what is still running after `grace_s`; returns once no process of those
    groups runs."""
    procs = list(procs)
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    _wait_for_groups(procs, grace_s)
    for proc in procs:
        if group_members(proc.pid):  # only a group still running: a gone group's id may since name another
            _signal_group(proc.pid, signal.SIGKILL)
    _wait_for_groups(procs, 30.0)


def _wait_for_groups(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(group_members(p.pid) for p in procs) and time.monotonic() < deadline:
        for proc in procs:
            proc.poll()  # reap a leader that ended
        time.sleep(0.1)


def group_members(pgid: int) -> list[int]:
    """The running (not zombie) processes of process group `pgid` (Linux /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is gone
        pass
