"""A LoRA run's checkpoints without a copy of the frozen base weights.

When a LoRA run's base weights come from a sealed weights-only directory (`checkpoint.init_from`, a converter's
output, or the SFT warm-start cache: `model/` + `model_config.yaml` + `manifest.json`), its trainer checkpoints
hold the adapters and their optimizer state only (model/ is megatron's dist checkpoint of the adapter tensors),
and checkpoint.json names the base:

    "lora_base": {"path": "/abs/path/of/the/base", "manifest_sha256": "<sha256 of its manifest.json>"}

The manifest lists the size and sha256 of every file of the base, so its own sha256 pins the base's content.
Loading such a checkpoint (resume, init_from, the HF export) loads the base first: the path must still hold a base
whose manifest has that sha256 and whose every file matches the manifest, else LoraBaseChangedError (the trainer
exits 2; the checkpoint itself is not moved aside, it is intact). A base that is the seed's initialisation (no
files) is saved in every checkpoint as before.
"""

from __future__ import annotations

from pathlib import Path

from exgrpo_megatron.checkpoint.compat import IncompatibleCheckpointError
from exgrpo_megatron.checkpoint.integrity import CheckpointVerificationError, file_digest, verify_weights_dir
from exgrpo_megatron.config.paths import TRAINER_MANIFEST, WEIGHTS_MANIFEST

BASE_KEY = "lora_base"  # checkpoint.json's entry naming the base weights


class LoraBaseChangedError(IncompatibleCheckpointError):
    """The base weights a LoRA checkpoint was trained on are gone or differ from those it names."""


def base_record(weights_dir: str | Path | None) -> dict | None:
    """checkpoint.json's `lora_base` for a run whose base was loaded from `weights_dir`; None (the checkpoints then
    hold the base) when there is no such directory or it is not a sealed weights-only one (a trainer checkpoint
    may itself depend on another base)."""
    if weights_dir is None:
        return None
    path = Path(weights_dir).expanduser().resolve()
    manifest = path / WEIGHTS_MANIFEST
    if not manifest.is_file() or (path / TRAINER_MANIFEST).is_file():
        return None
    return {"path": str(path), "manifest_sha256": file_digest(manifest)["sha256"]}


def verified_base_dir(record: dict, where: str) -> Path:
    """The base directory `record` names, checked: present, the same manifest, every file as the manifest says
    (collective when a process group is up). Raises LoraBaseChangedError naming what differs."""
    path = Path(record["path"])
    manifest = path / WEIGHTS_MANIFEST
    if not manifest.is_file():
        raise LoraBaseChangedError(f"{where} holds LoRA adapters only; their base weights {path} are gone (no "
                                   f"{WEIGHTS_MANIFEST}): restore that directory")
    if file_digest(manifest)["sha256"] != record["manifest_sha256"]:
        raise LoraBaseChangedError(f"{where} holds LoRA adapters trained on the base weights {path}, which have "
                                   f"changed since ({WEIGHTS_MANIFEST} sha256 {file_digest(manifest)['sha256']}, the "
                                   f"checkpoint names {record['manifest_sha256']}): restore the original base")
    try:
        verify_weights_dir(path)
    except CheckpointVerificationError as err:
        raise LoraBaseChangedError(f"{where} holds LoRA adapters on the base weights {path}, whose files no longer "
                                   f"match their manifest: {err.file}: {err.reason}") from err
    return path
