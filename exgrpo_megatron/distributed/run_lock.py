"""The run directory's lock, taken before anything is written into it.

One trainer per run directory. Two on one directory (a Slurm requeue while the old job still runs, a second
launch by hand) delete each other's in-progress checkpoints and write into replaced metrics files, so the
global rank 0 takes `<run_dir>/run.lock` before the process group, the model or any file exists:

* the lock is an exclusive `fcntl.flock` on that file, held for the life of the process; the kernel drops it
  when the last descriptor of the open file is closed, so when the holder dies however it dies (SIGKILL
  included) -- provided no other process holds a copy of the descriptor. The descriptor is close-on-exec (every
  descriptor Python opens is), and a child *forked* from the holder (megatron-core's checkpoint writers are) closes
  its copy right after the fork (`os.register_at_fork`): a writer orphaned by a `kill -9` of the trainer no longer
  keeps the run directory locked (and distributed/lifetime.py makes it die with the trainer anyway);
* the file says who holds it (pid, host, Slurm job, start time): a second launch exits with status 2 naming
  the holder;
* where the filesystem has no working flock (ENOLCK / EOPNOTSUPP), the holder recorded in the file decides:
  same host and its process gone (its pid free, or reused by a process with another start time) -> stale, taken
  over; otherwise refused.

The run directory is checked first (config/paths.run_dir_problem: a writable directory, or creatable; exit 2,
key `logging.run_dir`). The lock remembers what taking it created (the directories and the lock file); a start that
is refused (`release(refused=True)`) removes them again, empty directories only, so a refusal leaves nothing behind
and never touches anything that was there before.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from weakref import WeakSet

from exgrpo_megatron.config.paths import run_dir_problem

LOCK_FILE = "run.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


_HELD: WeakSet[RunDirLock] = WeakSet()  # the locks this process holds (a forked child closes its copies)


class RunDirError(RuntimeError):
    """The run directory cannot be used (not writable, not a directory, held by another trainer)."""


def holder_text(holder: dict[str, Any]) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {holder.get('started')}"


def pid_alive(pid: int) -> bool:
    """Is a process with this pid running on this host (one of another user's counts as running)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (/proc/<pid>/stat field 22); None where unknown. With the
    pid it names one process: a pid reused by a later process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return int(fh.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _holder_alive(holder: dict[str, Any]) -> bool:
    pid = int(holder.get("pid", -1))
    if not pid_alive(pid):
        return False
    recorded = holder.get("pid_start")
    return recorded is None or _process_start(pid) in (None, recorded)


def _read_holder(fh: IO[str]) -> dict[str, Any]:
    fh.seek(0)
    try:
        holder = json.loads(fh.read() or "{}")
    except ValueError:
        holder = {}
    return holder if isinstance(holder, dict) else {}


def _this_holder() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid_start": _process_start(os.getpid())}


@dataclass(eq=False)
class RunDirLock:
    """An acquired lock; `release()` (or process exit) gives it up."""

    path: Path
    handle: IO[str] | None
    created: tuple[Path, ...] = ()  # what acquiring created: the lock file and new directories, deepest first

    def release(self, refused: bool = False) -> None:
        """Give the lock up; `refused` (a start-up refusal): also remove what acquiring it created."""
        if self.handle is None:
            return
        if refused:
            self._remove_created()
        try:
            self.handle.seek(0)
            self.handle.truncate()  # an empty lock file: nobody holds it
            self.handle.flush()
        except OSError:
            pass
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None

    def _remove_created(self) -> None:
        """Still holding the lock: unlink the lock file if this start created it, then the directories it created
        while they are empty (a later launch that opened the unlinked file finds it replaced and retries)."""
        for created in self.created:
            try:
                if created == self.path:
                    created.unlink()
                else:
                    created.rmdir()  # only when empty: never what someone else put there meanwhile
            except OSError:
                return

    def drop_in_forked_child(self) -> None:
        """In a child forked from the holder: let go of the inherited descriptor without unlocking (the lock
        belongs to the open file, shared with the parent). The descriptor is pointed at /dev/null rather than
        closed, so the number is not reused while the file object still names it."""
        if self.handle is None:
            return
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(devnull, self.handle.fileno())
        finally:
            os.close(devnull)
        self.handle = None  # the file object is dropped with its /dev/null descriptor


def _drop_locks_in_forked_child() -> None:
    for lock in list(_HELD):
        lock.drop_in_forked_child()


os.register_at_fork(after_in_child=_drop_locks_in_forked_child)


def _claim_without_flock(fh: IO[str], path: Path) -> None:
    """Filesystems without flock: the recorded holder decides (stale only when it is provably gone)."""
    holder = _read_holder(fh)
    if not holder or holder.get("pid") == os.getpid():
        return
    if holder.get("host") == socket.gethostname() and not _holder_alive(holder):
        return  # stale: the holder on this host is gone (its pid is free, or taken by a later process)
    raise RunDirError(f"logging.run_dir: {path.parent} is in use by another trainer ({holder_text(holder)}); this "
                      f"filesystem has no file locks, so the holder cannot be checked from here: if it is gone, "
                      f"delete {path}")


def _new_directories(directory: Path) -> list[Path]:
    """The directories that creating `directory` would create, deepest first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    return missing


def _open_and_lock(path: Path, run_dir: str | Path) -> IO[str]:
    """Open and lock `path` (RunDirError when it is held or cannot be locked). A lock file that a refused start
    unlinked while this process waited is not the run's lock any more: opened again."""
    while True:
        try:
            fh = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the life of the run
        except OSError as err:
            raise RunDirError(f"logging.run_dir: {str(run_dir)!r}: cannot create {path}: {err.strerror or err}") \
                from err
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fh)
            fh.close()
            raise RunDirError(f"logging.run_dir: {path.parent} is in use by another trainer "
                              f"({holder_text(holder)}); two trainers on one run directory overwrite each other's "
                              "checkpoints and metrics. Wait for it to end, or use another logging.run_dir") from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                fh.close()
                raise RunDirError(f"logging.run_dir: cannot lock {path}: {err}") from err
            try:
                _claim_without_flock(fh, path)
            except RunDirError:
                fh.close()
                raise
        try:
            if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
                return fh
        except FileNotFoundError:
            pass
        fh.close()


def acquire_run_dir(run_dir: str | Path) -> RunDirLock:
    """Check the run directory, create it, and take its lock; RunDirError (a `logging.run_dir:` line) when the
    directory is unusable or a live trainer holds it."""
    problem = run_dir_problem(run_dir)
    if problem is not None:
        raise RunDirError(problem)
    path = Path(run_dir).expanduser() / LOCK_FILE
    new_dirs = _new_directories(path.parent)
    new_lock_file = not path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"logging.run_dir: {str(run_dir)!r}: cannot create {path}: {err.strerror or err}") from err
    fh = _open_and_lock(path, run_dir)
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps(_this_holder()) + "\n")
    fh.flush()
    os.fsync(fh.fileno())
    lock = RunDirLock(path, fh, created=(*([path] if new_lock_file else []), *new_dirs))
    _HELD.add(lock)
    return lock
