"""Weights-only directories: `checkpoint.init_from` (a converter's output), the SFT warm-start cache, and the
weights of a trainer checkpoint read as a start point.

    <dir>/model/              megatron dist_checkpointing of {"model"} (any TP/PP on load)
    <dir>/model_config.yaml   the `model:` config group (architecture check)
    <dir>/manifest.json       size + sha256 of every other file (integrity.write_weights_manifest), written last

Every read is verified first: a weights-only dir against its manifest.json, a trainer checkpoint against its
checkpoint.json; a bad file raises CheckpointVerificationError naming it. A dir without a manifest is loaded
with a warning only by tools that read older exports (evaluate.py); the trainer refuses it at start-up
(config/domains.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

import exgrpo_megatron.checkpoint.layout as L
from exgrpo_megatron.checkpoint.compat import check_model_compatible
from exgrpo_megatron.checkpoint.files import CheckpointFormatError, fsync_tree, write_text_durable
from exgrpo_megatron.checkpoint.integrity import (
    WEIGHTS_MANIFEST,
    read_root_manifest,
    verify_checkpoint,
    verify_weights_dir,
    write_weights_manifest,
)
from exgrpo_megatron.checkpoint.lora_base import BASE_KEY, verified_base_dir
from exgrpo_megatron.checkpoint.model_state import load_model_and_optimizer, save_model_and_optimizer
from exgrpo_megatron.config.schema import ModelConfig

MODEL_SUBDIR = "model"
MODEL_CONFIG_FILE = "model_config.yaml"


def verify_weights_source(path: Path) -> None:
    """Collective: verify a trainer checkpoint or a weights-only dir; a dir without any manifest: a warning."""
    if (path / L.ROOT_MANIFEST).is_file():
        verify_checkpoint(path)
    elif (path / WEIGHTS_MANIFEST).is_file():
        verify_weights_dir(path)
    else:
        warnings.warn(f"{path} has no {WEIGHTS_MANIFEST}: its files cannot be verified (re-export it with "
                      "tools/convert_hf_to_megatron.py to seal it)", stacklevel=3)


def load_model_weights(path: str | Path, model_chunks: list, *, model_config: ModelConfig | None = None,
                       allow_model_changes: Sequence[str] = ()) -> None:
    """Weights only (`checkpoint.init_from`, the SFT cache, a trainer checkpoint's weights); verified first, then
    compared with `model_config` (compat.check_model_compatible; `allow_model_changes`: the function fields it may
    differ in). Collective. Call it before building the optimizer, or call `optimizer.reload_model_params()` after,
    so 16-bit models' fp32 master weights pick the new values up."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"weights-only checkpoint {path} does not exist (or is not a directory)")
    verify_weights_source(path)
    if model_config is not None:
        config_path = path / MODEL_CONFIG_FILE
        if not config_path.is_file():
            raise CheckpointFormatError(f"{path} has no {MODEL_CONFIG_FILE}; cannot check its architecture")
        check_model_compatible(config_path.read_text(encoding="utf-8"), model_config, str(path), allow_model_changes)
    if (path / L.ROOT_MANIFEST).is_file() and BASE_KEY in (root := read_root_manifest(path)):
        load_lora_base(root[BASE_KEY], model_chunks, str(path))  # a LoRA checkpoint of the adapters alone
    load_model_and_optimizer(path / MODEL_SUBDIR, model_chunks, optimizer=None)


def load_lora_base(record: dict, model_chunks: list, where: str) -> None:
    """Collective: the base weights a LoRA checkpoint of adapters alone names (checkpoint/lora_base.py), verified,
    into the model; its adapters are loaded after."""
    load_model_and_optimizer(verified_base_dir(record, where) / MODEL_SUBDIR, model_chunks, optimizer=None)


def save_model_weights(path: str | Path, model_chunks: list, *, model_config_yaml: str) -> Path:
    """Collective: a weights-only checkpoint (`model/` with the "model" key + `model_config.yaml` +
    `manifest.json`), the layout of a converted HF checkpoint; readable by load_model_weights at any TP/PP.
    Not atomic: meant for conversion tools writing a fresh directory (the manifest, written last, marks it
    complete)."""
    path = Path(path)
    if dist.get_rank() == 0:
        (path / MODEL_SUBDIR).mkdir(parents=True, exist_ok=True)
        write_text_durable(path / MODEL_CONFIG_FILE, model_config_yaml)
    dist.barrier()
    save_model_and_optimizer(path / MODEL_SUBDIR, model_chunks, optimizer=None)
    dist.barrier()
    if dist.get_rank() == 0:
        fsync_tree(path)
        write_weights_manifest(path)
    dist.barrier()
    return path
