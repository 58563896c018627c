"""Where checkpoints live in a run directory, which one is the newest complete one, and retention.

    <run_dir>/checkpoints/latest          text: name of the newest checkpoint dir written (a hint for people
                                          and tools; resume does not trust it)
    <run_dir>/checkpoints/step_00000050/  complete (created as .tmp_step_00000050, then renamed)
    <run_dir>/checkpoints/.tmp_*          incomplete or being deleted: ignored, removed at the next save
    <run_dir>/checkpoints/rejected/       checkpoints that failed verification, moved aside (never deleted),
                                          each with a step_X.reason.txt

Crash safety: a directory only ever gets a `step_*` name through one atomic rename after all its
files are fsync'd, and leaves that name (before deletion) through another rename to `.tmp_*`. So at
any instant every `step_*` directory is complete. Resume takes the newest `step_*` directory that verifies
(checkpointer.load_newest_verified), whatever `latest` says: a kill between the rename and the pointer
update would otherwise cost the steps since the previous checkpoint.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from exgrpo_megatron.checkpoint.files import fsync_path, replace_atomic
from exgrpo_megatron.config.paths import TRAINER_MANIFEST

CHECKPOINTS_SUBDIR = "checkpoints"
LATEST_FILE = "latest"
ROOT_MANIFEST = TRAINER_MANIFEST  # written last inside a checkpoint: marks a trainer checkpoint
TMP_PREFIX = ".tmp_"
REJECTED_SUBDIR = "rejected"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_SUBDIR


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete_checkpoint(path: Path) -> bool:
    return step_of(path) is not None and (path / ROOT_MANIFEST).is_file()


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints under `ckpt_dir`, oldest step first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and is_complete_checkpoint(p)]
    return sorted(found, key=lambda p: step_of(p) or 0)


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run: the complete `step_*` dir with the highest step (the
    `latest` pointer is not consulted: it may be stale, missing or torn). Not verified: see
    checkpointer.load_newest_verified."""
    candidates = complete_checkpoints(checkpoints_dir(run_dir))
    return candidates[-1] if candidates else None


def newest_if_run_dir(path: str) -> str:
    """A run directory (one with `checkpoints/`) -> its newest complete checkpoint; any other path unchanged.
    How the tools that take "a run, a checkpoints dir or a step dir" (evaluate.py, convert_megatron_to_hf.py)
    pick a run's checkpoint."""
    if not checkpoints_dir(path).is_dir():
        return path
    latest = find_latest(path)
    if latest is None:
        raise FileNotFoundError(f"{path}: run directory without a complete checkpoint")
    return str(latest)


def resume_candidates(run_dir: str | Path, resume: str) -> tuple[list[Path], bool]:
    """`checkpoint.resume` -> (checkpoints to try, newest first; explicit). "auto": this run's complete
    checkpoints; "none": nothing; a checkpoint dir: just it (explicit: no fallback); a run or checkpoints
    dir: its complete checkpoints. FileNotFoundError for a path with no complete checkpoint."""
    mode = resume.strip()
    if mode.lower() == "auto":
        return complete_checkpoints(checkpoints_dir(run_dir))[::-1], False
    if mode.lower() in ("none", "", "null", "false"):
        return [], False
    path = Path(mode).expanduser()
    if (path / ROOT_MANIFEST).is_file():
        return [path], True
    run_dir_of_path = path.parent if path.name == CHECKPOINTS_SUBDIR else path
    found = complete_checkpoints(checkpoints_dir(run_dir_of_path))[::-1]
    if not found:
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r}: no complete checkpoint (a dir with {ROOT_MANIFEST}) at {path}"
        )
    return found, False


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """The first checkpoint resume_candidates would try (unverified), or None."""
    candidates, _explicit = resume_candidates(run_dir, resume)
    return candidates[0] if candidates else None


def move_aside(path: Path, reason: str) -> Path:
    """Move a checkpoint that failed verification to `<checkpoints>/rejected/` (out of the `step_*`
    namespace, never deleted) with a `<name>.reason.txt` beside it; returns its new path."""
    rejected = path.parent / REJECTED_SUBDIR
    rejected.mkdir(exist_ok=True)
    dest = rejected / path.name
    n = 1
    while dest.exists():
        dest, n = rejected / f"{path.name}.{n}", n + 1
    path.rename(dest)
    fsync_path(path.parent)
    (rejected / f"{dest.name}.reason.txt").write_text(reason + "\n", encoding="utf-8")
    fsync_path(rejected)
    return dest


def write_latest_pointer(ckpt_dir: Path, name: str) -> None:
    replace_atomic(ckpt_dir / LATEST_FILE, name + "\n")


def update_latest_pointer(ckpt_dir: Path, name: str) -> None:
    """write_latest_pointer after a publish: `latest` is a hint (resume never trusts it) and the checkpoint is
    already saved, so a pointer that cannot be written (e.g. replaced by a directory) is a warning only."""
    try:
        write_latest_pointer(ckpt_dir, name)
    except OSError as err:
        print(f"exgrpo-train: warning: checkpoint {ckpt_dir / name} is saved, but the pointer "
              f"{ckpt_dir / LATEST_FILE} could not be updated ({type(err).__name__}: {err})",
              file=sys.stderr, flush=True)


def remove_stale_tmp_dirs(ckpt_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted saves/deletions (anything named .tmp_*)."""
    removed: list[Path] = []
    if not ckpt_dir.is_dir():
        return removed
    for entry in ckpt_dir.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def delete_checkpoint(path: Path) -> None:
    """Retire a checkpoint: atomically rename it out of the `step_*` namespace, then delete it, so
    a crash mid-deletion never leaves a half-deleted dir that looks complete."""
    doomed = path.with_name(f"{TMP_PREFIX}deleting_{path.name}")
    path.rename(doomed)
    fsync_path(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def apply_retention(ckpt_dir: Path, keep_last: int, newest: Path, verified: set[Path] | None = None) -> list[Path]:
    """Keep the `keep_last` newest VERIFIED checkpoints (`verified`: their resolved paths; None = all complete
    ones count as verified) and everything newer than the oldest of them; delete only complete
    checkpoints older than that. So an unverified checkpoint never causes a deletion, and with fewer
    than `keep_last` verified checkpoints nothing is deleted. `newest` is always kept; keep_last <= 0
    keeps everything. Returns the deleted paths."""
    if keep_last <= 0:
        return []
    checkpoints = complete_checkpoints(ckpt_dir)
    trusted = [p for p in checkpoints if verified is None or p.resolve() in verified]
    if len(trusted) < keep_last:
        return []
    oldest_kept = step_of(trusted[-keep_last]) or 0
    doomed = [p for p in checkpoints if (step_of(p) or 0) < oldest_kept and p.resolve() != newest.resolve()]
    for path in doomed:
        delete_checkpoint(path)
    return doomed


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically give a fully written and fsync'd `tmp_dir` its final `step_*` name. An existing
    dir of the same name (a re-save of the same step) is retired first."""
    replaced = final_dir.with_name(f"{TMP_PREFIX}replaced_{final_dir.name}")
    if final_dir.exists():
        final_dir.rename(replaced)
    tmp_dir.rename(final_dir)
    fsync_path(final_dir.parent)
    if replaced.exists():
        shutil.rmtree(replaced, ignore_errors=True)
