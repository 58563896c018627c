"""Checkpoints: atomic, durable, reshardable save/load of model, optimizer, pool, RNG and trainer
state (checkpointer.py), per-file size + sha256 verification (integrity.py), resume from the newest
checkpoint that verifies (resume.py), the run-directory layout and `latest` pointer (layout.py)."""

from exgrpo_megatron.checkpoint.checkpointer import (
    CheckpointSaveError,
    InsufficientDiskSpaceError,
    LoadedCheckpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    save_model_weights,
)
from exgrpo_megatron.checkpoint.compat import IncompatibleCheckpointError, model_config_to_yaml
from exgrpo_megatron.checkpoint.disk import NoRoomForCheckpointError, check_room_for_checkpoint
from exgrpo_megatron.checkpoint.files import CheckpointFormatError
from exgrpo_megatron.checkpoint.integrity import CheckpointVerificationError, verify_checkpoint
from exgrpo_megatron.checkpoint.layout import checkpoints_dir, find_latest, resolve_resume
from exgrpo_megatron.checkpoint.resume import load_newest_verified

__all__ = [
    "CheckpointFormatError",
    "CheckpointSaveError",
    "CheckpointVerificationError",
    "IncompatibleCheckpointError",
    "InsufficientDiskSpaceError",
    "LoadedCheckpoint",
    "NoRoomForCheckpointError",
    "check_room_for_checkpoint",
    "checkpoints_dir",
    "find_latest",
    "load_checkpoint",
    "load_model_weights",
    "load_newest_verified",
    "model_config_to_yaml",
    "resolve_resume",
    "save_checkpoint",
    "save_model_weights",
    "verify_checkpoint",
]
