"""No process outlives the trainer that started it.

A trainer (and the generator process of a run generating ahead) starts helpers: megatron-core's checkpoint writers are
*forked* (`filesystem_async.py`, one per write bucket), the generator is spawned (training/async_generation/), the
grader's fork server and workers are started through a fork server (reward/grader.py). When the trainer dies without
running its clean-up -- SIGKILL, the OOM killer, a crashed node agent -- a forked writer blocked on a queue its parent
will never read waits forever, and while it lives it holds copies of the trainer's descriptors: the grader fork
server's liveness pipe (so the server and its workers stay too) and, before the run lock closed its descriptor in
forked children (distributed/run_lock.py), the lock itself.

`die_with_parent()` asks the kernel to SIGKILL the calling process when its parent dies (Linux
`prctl(PR_SET_PDEATHSIG)`; elsewhere a thread that polls the parent's pid). `install_fork_hooks()` makes every child
this process forks from Python (`os.fork`, multiprocessing's 'fork' context) call it right after the fork. The
kernel's "parent" is the *thread* that forked: a child forked from the main thread gets the signal; one forked from
another thread (which may end before the child should) gets the polling thread instead. A parent that died between
the fork and the prctl is caught by comparing the parent pid with the one recorded before the fork.

A *spawned* child (multiprocessing 'spawn': the checkpoint writers' results Manager, the generator) inherits no such
signal: its parent passes `parent_token()` (its pid, and whether the spawning thread is the main one) and the child
calls `die_with_parent(*token)` first thing (the Manager in its initializer), which also exits at once when the
parent is already gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_SECONDS = 1.0
_hooks_installed = False
_fork_state: dict[str, object] = {}


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_POLL_SECONDS)
    os._exit(1)


def die_with_parent(parent_pid: int | None = None, kernel: bool = True) -> None:
    """This process is killed when its parent `parent_pid` (default: the current parent) dies. `kernel` False (or
    not Linux): a daemon thread polls the parent pid instead of the kernel's death signal."""
    parent = os.getppid() if parent_pid is None else parent_pid
    armed = False
    if kernel and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:
        threading.Thread(target=_exit_when_orphaned, args=(parent,), name="exit-with-parent", daemon=True).start()


def parent_token() -> tuple[int, bool]:
    """What a process passes to a child it spawns, for the child's `die_with_parent(*token)`: its pid, and whether the
    kernel's parent-death signal can be used (the spawning thread is the main one, which lives as long as the
    process; another thread may end first, and then the child polls instead)."""
    return os.getpid(), threading.current_thread() is threading.main_thread()


def _before_fork() -> None:
    _fork_state["pid"] = os.getpid()
    _fork_state["main_thread"] = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    parent = _fork_state.get("pid")
    if isinstance(parent, int):
        die_with_parent(parent, kernel=bool(_fork_state.get("main_thread")))


def install_fork_hooks() -> None:
    """Every child forked from Python from now on dies with this process (idempotent)."""
    global _hooks_installed
    if _hooks_installed:
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _hooks_installed = True
