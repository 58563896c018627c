"""Disk space at start-up and before a save, and what to say when a save's writes fail.

At start-up (check_room_for_checkpoint, before step 1: the size is known then -- parameters, optimizer state, the
pool as loaded, the newest checkpoint's size) and before each save (rank 0, checkpointer._preflight) the leftovers
of interrupted or failed saves (`.tmp_*`) are removed first, then the free space is compared with the expected
size; a refusal at start-up exits 2. A write that fails during the save (a full disk surfaces from megatron's C++
writer as `basic_ios::clear: iostream error` or `unexpected pos`, without errno or path) is reported with the
checkpoint path, the OS reason and the free space left.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import exgrpo_megatron.checkpoint.layout as L
from exgrpo_megatron.checkpoint.files import directory_size_bytes
from exgrpo_megatron.checkpoint.model_state import local_param_bytes
from exgrpo_megatron.checkpoint.pool_io import PoolShard, is_pool_writer, pool_nbytes
from exgrpo_megatron.config.validate import ConfigError

# below this many free bytes after a failed write, the failure is reported as a full disk
NEARLY_FULL_BYTES = 1 << 20


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB (1536 bytes)': the unit that keeps the number readable, plus the exact count."""
    value, unit = float(n), "bytes"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({n} bytes)"


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_ancestor(path)).free


def expected_checkpoint_bytes(ckpt_dir: Path, fresh_estimate: int) -> int:
    """max(size of the newest complete checkpoint, param+optimizer+pool estimate of this save)."""
    existing = L.complete_checkpoints(ckpt_dir)
    return max(directory_size_bytes(existing[-1]) if existing else 0, fresh_estimate)


def what_frees_space(ckpt_dir: Path) -> str:
    """What a user can do about a checkpoint that does not fit: retention (`checkpoint.keep_last`) removes old
    checkpoints only after a new one is written, so it cannot make room for the next save; deleting old ones can."""
    older = L.complete_checkpoints(ckpt_dir)
    delete = (f" (delete those of the {len(older)} checkpoints under {ckpt_dir} you no longer need: the run "
              "resumes from the newest that verifies)" if older else "")
    return f"Free space on that filesystem{delete}, or point logging.run_dir at a filesystem with more room."


def disk_space_error(ckpt_dir: Path, needed: int, refusing: str = "refusing to save a checkpoint") -> str | None:
    """None when the filesystem of `ckpt_dir` has `needed` bytes free, else the refusal, starting with `refusing`
    (call it after L.remove_stale_tmp_dirs: leftovers of failed saves must not count against the new one)."""
    where = existing_ancestor(ckpt_dir)
    free = shutil.disk_usage(where).free
    if free >= needed:
        return None
    return (f"{refusing} into {ckpt_dir}: {human_bytes(free)} free on the filesystem of {where}, but the checkpoint "
            f"needs about {human_bytes(needed)} (size of the last checkpoint, or the parameter+optimizer+pool "
            f"estimate). {what_frees_space(ckpt_dir)}")


def room_error(ckpt_dir: Path, fresh_estimate: int, refusing: str) -> str | None:
    """Rank 0: remove the leftovers of failed saves, then compare the free space with the expected size."""
    L.remove_stale_tmp_dirs(ckpt_dir)  # first: a failed save's leftover must not block the next one
    return disk_space_error(ckpt_dir, expected_checkpoint_bytes(ckpt_dir, fresh_estimate), refusing)


class NoRoomForCheckpointError(ConfigError):
    """At start-up: the run's next checkpoint cannot fit on its filesystem (exit 2, as every start-up refusal)."""


def check_room_for_checkpoint(run_dir: str | Path, model_chunks: list, pool_shard: PoolShard | None) -> None:
    """Collective, before step 1: raise NoRoomForCheckpointError on every rank when the filesystem of the run's
    checkpoints cannot hold the next checkpoint (the same estimate as before each save: parameters + optimizer state
    of one DP replica, the pool as loaded, at least the newest checkpoint's size). `pool_shard`: this DP replica's
    pool as it would be saved, or None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = ((local_param_bytes(model_chunks) if ps.get_data_parallel_rank() == 0 else 0)
             + (pool_nbytes(pool_shard) if is_pool_writer() else 0))
    sizes: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, local)
    ckpt_dir = L.checkpoints_dir(run_dir)
    box = [room_error(ckpt_dir, sum(s or 0 for s in sizes), "refusing to start: the next checkpoint will not fit")
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise NoRoomForCheckpointError([f"logging.run_dir: {run_dir}: {box[0]}"])


def write_error_message(err: BaseException, tmp_dir: Path) -> str:
    """What a failed save says: the checkpoint path, the OS reason ("no space left on device" when the
    filesystem is full, whatever the writer's own message) and the free space left."""
    free = free_bytes(tmp_dir)
    no_space = getattr(err, "errno", None) == errno.ENOSPC or free < NEARLY_FULL_BYTES
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    writer = f"{type(err).__name__}: {lines[-1] if lines else ''}"  # megatron's: the worker's last line
    reason = f"no space left on device (writer said: {writer})" if no_space else writer
    return (f"saving checkpoint {tmp_dir} failed: {reason}; {human_bytes(free)} free on the filesystem of "
            f"{existing_ancestor(tmp_dir.parent)}. The partial save is removed; earlier checkpoints are untouched.")
