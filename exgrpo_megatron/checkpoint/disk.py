"""Disk space before a save, and what to say when a save's writes fail.

Before a save (rank 0, checkpointer._preflight) the leftovers of interrupted or failed saves (`.tmp_*`) are
removed first, then the free space is compared with the expected size. A write that fails during the save
(a full disk surfaces from megatron's C++ writer as `basic_ios::clear: iostream error` or `unexpected pos`,
without errno or path) is reported with the checkpoint path, the OS reason and the free space left.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import exgrpo_megatron.checkpoint.layout as L
from exgrpo_megatron.checkpoint.files import directory_size_bytes

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


def disk_space_error(ckpt_dir: Path, needed: int) -> str | None:
    """None when the filesystem of `ckpt_dir` has `needed` bytes free, else the refusal (call it after
    L.remove_stale_tmp_dirs: leftovers of failed saves must not count against the new one)."""
    where = existing_ancestor(ckpt_dir)
    free = shutil.disk_usage(where).free
    if free >= needed:
        return None
    return (f"refusing to save a checkpoint into {ckpt_dir}: {human_bytes(free)} free on the filesystem of {where}, "
            f"but the checkpoint needs about {human_bytes(needed)} (size of the last checkpoint, or the "
            "parameter+optimizer+pool estimate). Free space or lower checkpoint.keep_last.")


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
