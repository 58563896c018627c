"""Resume: the newest checkpoint of a run that verifies, with loud fallback past corrupted ones.

`latest` is only a hint; the candidates are the complete `step_*` dirs, newest first
(layout.resume_candidates). Each is verified (integrity.verify_checkpoint: every file's size + sha256,
split over the ranks, verdict agreed by all) as the first part of load_checkpoint; one that fails is
named with its file and reason, moved to `checkpoints/rejected/` (never deleted) and the next older
one is tried. All ranks walk the same candidate list (rank 0's, broadcast) and reach the same verdicts,
so they all load the same checkpoint.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

import exgrpo_megatron.checkpoint.layout as L
from exgrpo_megatron.checkpoint.checkpointer import LoadedCheckpoint, load_checkpoint
from exgrpo_megatron.checkpoint.files import CheckpointFormatError
from exgrpo_megatron.checkpoint.integrity import CheckpointVerificationError


def _broadcast_from_rank0(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _reject(err: CheckpointVerificationError) -> None:
    """Collective: rank 0 moves the checkpoint aside and says so loudly; everyone waits for the move."""
    if dist.get_rank() == 0:
        try:
            where = f"moved aside to {L.move_aside(err.path, str(err))} (not deleted)"
        except OSError as move_err:  # e.g. a read-only file system: leave it, but never trust it
            where = f"could not be moved aside ({move_err}); left in place"
        message = (f"exgrpo-train: CHECKPOINT REJECTED: {err.path}: {err.file}: {err.reason}\n"
                   f"exgrpo-train:   {where}; trying the next older checkpoint")
        print(message, file=sys.stderr, flush=True)
        warnings.warn(message, stacklevel=3)
    dist.barrier()


def load_newest_verified(run_dir: str | Path, resume: str, **load_kwargs: Any) -> LoadedCheckpoint | None:
    """Collective: `checkpoint.resume` -> the newest checkpoint that verifies, loaded (load_checkpoint's
    keyword arguments), or None when there is none to resume from. Checkpoints that fail verification are
    moved aside and the next older one is tried; an explicitly named checkpoint dir is never moved and
    its failure raises. Raises CheckpointFormatError when checkpoints existed but none verified."""
    found: tuple[list[Path], bool] | str = ([], False)
    if dist.get_rank() == 0:
        try:
            found = L.resume_candidates(run_dir, resume)
        except FileNotFoundError as err:  # every rank raises it, none waits in a collective
            found = str(err)
    found = _broadcast_from_rank0(found)
    if isinstance(found, str):
        raise FileNotFoundError(found)
    candidates, explicit = found
    rejected: list[CheckpointVerificationError] = []
    for path in candidates:
        try:
            loaded = load_checkpoint(path, **load_kwargs)
        except CheckpointVerificationError as err:
            if explicit:
                raise
            _reject(err)
            rejected.append(err)
            continue
        loaded.rejected = rejected
        if rejected and dist.get_rank() == 0:
            print(f"exgrpo-train: FELL BACK to the older checkpoint {path} (step {loaded.step}): "
                  f"{len(rejected)} newer checkpoint(s) failed verification", file=sys.stderr, flush=True)
        return loaded
    if rejected:
        raise CheckpointFormatError(
            "no checkpoint to resume from verified; rejected (moved to checkpoints/rejected/):\n  "
            + "\n  ".join(str(e) for e in rejected)
            + "\nset checkpoint.resume=none to start afresh, or checkpoint.resume=<dir> to pick one")
    return None
