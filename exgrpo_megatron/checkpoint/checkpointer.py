"""Save and load a whole training checkpoint: model, optimizer, LR scheduler, pool shards, RNG, trainer state.

Layout, inside `<run_dir>/checkpoints/step_XXXXXXXX/`:

    model/                 megatron dist_checkpointing (torch_dist) of {"model"|"model0".., "optimizer"};
                           sharded by global tensor keys, so it loads at any TP/PP/DP layout
    model_config.yaml      the `model:` config group (architecture check on load)
    config.yaml            the full resolved run config
    pool/                  experience-pool shards, one per DP replica (pool_io.py)
    state/trainer_state.json, state/opt_param_scheduler.json, state/rng/rank_*.{json,safetensors}
    checkpoint.json        root manifest, written last: format version, step, process layout, the
                           sha256 of every file above that is not megatron's, and "file_digests": size +
                           sha256 of EVERY file of the checkpoint (integrity.py), verified on load

Protocol (collective; every rank calls save_checkpoint): preflight (disk space, inputs) decided on rank 0
and broadcast, so all ranks fail together -> rank 0 removes stale `.tmp_*` dirs and creates
`.tmp_step_X/` -> everyone writes into it (each file fsync'd by its writer) -> barrier -> every rank
hashes its share of the files -> rank 0 writes checkpoint.json, fsyncs the tree, renames to `step_X`,
replaces `latest` atomically, applies retention. A process killed at any instant leaves the previous
complete checkpoint loadable (see layout.py).

Resume (load_newest_verified): newest complete `step_*` dir first; one that fails verification is named
(file + reason), moved to `checkpoints/rejected/` and the next older one is tried. Retention counts only
checkpoints this process has verified or written (integrity._VERIFIED).
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.api import CheckpointException

import exgrpo_megatron.checkpoint.layout as L
from exgrpo_megatron.checkpoint.compat import check_expert_layout, check_model_compatible
from exgrpo_megatron.checkpoint.disk import room_error, write_error_message
from exgrpo_megatron.checkpoint.files import (
    FORMAT_VERSION,
    fsync_tree,
    read_verified,
    write_json_durable,
    write_text_durable,
)
from exgrpo_megatron.checkpoint.integrity import (
    _VERIFIED,
    DIGESTS_KEY,
    SEAL_KEY,
    CheckpointVerificationError,
    digest_files,
    list_files,
    manifest_seal,
    my_share,
    read_root_manifest,  # noqa: F401 - re-exported: callers read manifests from here
    verify_checkpoint,
)
from exgrpo_megatron.checkpoint.lora_base import BASE_KEY
from exgrpo_megatron.checkpoint.model_state import (
    load_model_and_optimizer,
    local_param_bytes,
    model_keys,
    padded_vocab,
    save_model_and_optimizer,
)
from exgrpo_megatron.checkpoint.pool_io import (
    POOL_MANIFEST,
    POOL_SUBDIR,
    PoolShard,
    check_shard_entries,
    is_pool_writer,
    pool_nbytes,
    read_pool_shards,
    write_pool_manifest,
    write_pool_shard,
)
from exgrpo_megatron.checkpoint.rng_io import RNG_SUBDIR, restore_rng_state, write_rng_state
from exgrpo_megatron.checkpoint.scheduler_state import (
    config_group_values,
    reapply_config_group_values,
    restore_scheduler,
)
from exgrpo_megatron.checkpoint.weights import (  # noqa: F401 - load/save_model_weights re-exported
    MODEL_CONFIG_FILE,
    MODEL_SUBDIR,
    load_lora_base,
    load_model_weights,
    save_model_weights,
)
from exgrpo_megatron.config.schema import ModelConfig

STATE_SUBDIR = "state"
# what a failed write raises: torch.distributed.checkpoint's CheckpointException (megatron's writer) is a
# BaseException, not an Exception
WRITE_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)
RUN_CONFIG_FILE = "config.yaml"
TRAINER_STATE_FILE = f"{STATE_SUBDIR}/trainer_state.json"
SCHEDULER_FILE = f"{STATE_SUBDIR}/opt_param_scheduler.json"
POOL_MANIFEST_FILE = f"{POOL_SUBDIR}/{POOL_MANIFEST}"


class CheckpointSaveError(RuntimeError):
    """A save was refused before anything was written (bad inputs, inconsistent pool shards)."""


class InsufficientDiskSpaceError(CheckpointSaveError, OSError):
    """Free disk space is below the checkpoint's expected size; nothing was written."""


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    trainer_state: dict
    pool_shards: list[PoolShard]  # ALL shards, dp_rank order, whatever the current DP size
    config_yaml: str | None
    model_config_yaml: str
    rng_restored: bool
    rejected: list[CheckpointVerificationError] | None = None  # newer checkpoints that failed verification
    lora_base: dict | None = None  # the base weights a checkpoint of LoRA adapters alone names (lora_base.py)


# ----------------------------------------------------------------------------- process layout


def process_layout() -> dict[str, int]:
    """World size and parallel sizes: RNG streams restore only when they match, Adam state only at the saved EP/ETP."""
    from megatron.core import parallel_state as ps

    return {
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "world_size": dist.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    }


def _all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _broadcast_from_rank0(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------- save


def _preflight(
    ckpt_dir: Path, step: int, local_pool: PoolShard | None, pool_shard_index: tuple[int, int], model_chunks: list,
    trainer_state: dict, opt_param_scheduler, model_config_yaml: str, dp_rank_of_this_rank: int,
) -> None:
    """Collective checks before anything is written (rank 0 decides, everyone raises the same error);
    on success rank 0 has removed stale .tmp_* dirs and created the empty .tmp_step_X tree."""
    info = {
        "param_bytes": local_param_bytes(model_chunks) if dp_rank_of_this_rank == 0 else 0,
        "pool_bytes": pool_nbytes(local_pool),
        "pool_index": list(pool_shard_index) if local_pool is not None else None,
    }
    everyone = _all_gather(info)
    error: str | None = None
    disk_error = False
    if dist.get_rank() == 0:
        try:
            indices = [tuple(e["pool_index"]) for e in everyone if e["pool_index"] is not None]
            dp_sizes = {size for _, size in indices}
            if len(dp_sizes) > 1:
                raise ValueError(f"pool shards disagree on dp_size: {sorted(dp_sizes)}")
            if indices:
                check_shard_entries([{"dp_rank": r} for r, _ in indices], dp_sizes.pop())
            json.dumps(trainer_state)
            if opt_param_scheduler is not None:
                json.dumps(opt_param_scheduler.state_dict())
            yaml.safe_load(model_config_yaml)
            error = room_error(ckpt_dir, sum(e["param_bytes"] + e["pool_bytes"] for e in everyone),
                               "refusing to save a checkpoint")
            disk_error = error is not None
            if error is None:
                tmp = ckpt_dir / (L.TMP_PREFIX + L.step_dir_name(step))
                for sub in (MODEL_SUBDIR, POOL_SUBDIR, f"{STATE_SUBDIR}/{RNG_SUBDIR}"):
                    (tmp / sub).mkdir(parents=True, exist_ok=True)
        except Exception as err:  # noqa: BLE001 - must reach the other ranks, or they wait forever
            error = f"refusing to save checkpoint step {step}: {type(err).__name__}: {err}"
    error, disk_error = _broadcast_from_rank0((error, disk_error))
    if error is not None:
        raise (InsufficientDiskSpaceError if disk_error else CheckpointSaveError)(error)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model_chunks: list,
    optimizer,
    opt_param_scheduler=None,
    pool_shard: PoolShard | None = None,
    pool_shard_index: tuple[int, int] = (0, 1),
    trainer_state: dict,
    config_yaml: str,
    model_config_yaml: str,
    keep_last: int = 2,
    lora_base: dict | None = None,
) -> Path:
    """Collective: write checkpoint `step` of the run atomically and durably; return its final path.

    `pool_shard` is this DP replica's (arrays, meta); only the pool-writer rank of each replica
    (tp0/pp0/cp0) writes it, so the other ranks may pass it or None. `trainer_state` (JSON-able) and
    the YAML texts are taken from rank 0. `keep_last` <= 0 keeps every checkpoint. `lora_base`
    (lora_base.base_record): the model's LoRA adapters are saved without the base weights, which it names.
    """
    from megatron.core import parallel_state as ps

    ckpt_dir = L.checkpoints_dir(run_dir)
    final_dir = ckpt_dir / L.step_dir_name(step)
    tmp_dir = ckpt_dir / (L.TMP_PREFIX + final_dir.name)
    rank = dist.get_rank()
    local_pool = pool_shard if is_pool_writer() else None
    _preflight(ckpt_dir, step, local_pool, pool_shard_index, model_chunks, trainer_state, opt_param_scheduler,
               model_config_yaml, ps.get_data_parallel_rank())
    dist.barrier()

    pool_entry = rng_entry = write_error = None
    try:
        save_model_and_optimizer(tmp_dir / MODEL_SUBDIR, model_chunks, optimizer, adapters_only=lora_base is not None)
        if local_pool is not None:
            pool_entry = write_pool_shard(tmp_dir / POOL_SUBDIR, local_pool, *pool_shard_index)
        rng_entry = write_rng_state(tmp_dir / STATE_SUBDIR / RNG_SUBDIR, rank)
    except WRITE_ERRORS as err:  # every rank must learn it (a full disk, a dead filesystem)
        write_error = write_error_message(err, tmp_dir)
    _raise_if_any_failed(_all_gather(write_error), tmp_dir)
    pool_entries = [e for e in _all_gather(pool_entry) if e is not None]
    rng_entries = _all_gather(rng_entry)

    return _finish_save(tmp_dir, final_dir, step, model_chunks, opt_param_scheduler, pool_entries, rng_entries,
                        pool_shard_index, trainer_state, config_yaml, model_config_yaml, keep_last, lora_base)


def _raise_if_any_failed(errors: list[str | None], tmp_dir: Path) -> None:
    """Collective verdict on a write phase: rank 0 removes the partial save, every rank raises the first error."""
    first = next((e for e in errors if e is not None), None)
    if first is None:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    dist.barrier()
    raise CheckpointSaveError(first)


def _write_small_files(tmp_dir: Path, step: int, model_chunks: list, opt_param_scheduler, pool_entries: list,
                       rng_entries: list, pool_shard_index: tuple[int, int], trainer_state: dict, config_yaml: str,
                       model_config_yaml: str) -> dict:
    """Rank 0: configs, trainer/scheduler state, pool manifest; returns the root manifest without digests."""
    files = {
        MODEL_CONFIG_FILE: write_text_durable(tmp_dir / MODEL_CONFIG_FILE, model_config_yaml),
        RUN_CONFIG_FILE: write_text_durable(tmp_dir / RUN_CONFIG_FILE, config_yaml),
        TRAINER_STATE_FILE: write_json_durable(tmp_dir / TRAINER_STATE_FILE, trainer_state),
        POOL_MANIFEST_FILE: write_pool_manifest(
            tmp_dir / POOL_SUBDIR, check_shard_entries(pool_entries, pool_shard_index[1]), pool_shard_index[1]
        ),
    }
    if opt_param_scheduler is not None:
        files[SCHEDULER_FILE] = write_json_durable(tmp_dir / SCHEDULER_FILE, opt_param_scheduler.state_dict())
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": process_layout(),
        "model_keys": model_keys(len(model_chunks)),
        "padded_vocab_size": padded_vocab(model_chunks),
        "files": files,
        "rng": {str(r): e for r, e in enumerate(rng_entries)},
    }


def _rank0_step(tmp_dir: Path, fn, *args: Any) -> Any:
    """Run `fn` on rank 0; a failure there (a full disk) is raised on every rank, the partial save removed."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn(*args)
        except WRITE_ERRORS as err:  # must reach the other ranks, or they wait forever
            error = write_error_message(err, tmp_dir)
    _raise_if_any_failed(_all_gather(error), tmp_dir)
    return result


def _seal_and_publish(tmp_dir: Path, final_dir: Path, root: dict, digests: list[dict]) -> None:
    root[DIGESTS_KEY] = {name: entry for share in digests for name, entry in share.items()}
    root[SEAL_KEY] = manifest_seal(root)
    write_json_durable(tmp_dir / L.ROOT_MANIFEST, root)
    fsync_tree(tmp_dir)  # megatron's common.pt / metadata files are not fsync'd by megatron
    L.publish(tmp_dir, final_dir)


def _finish_save(tmp_dir: Path, final_dir: Path, step: int, model_chunks: list, opt_param_scheduler,
                 pool_entries: list, rng_entries: list, pool_shard_index: tuple[int, int], trainer_state: dict,
                 config_yaml: str, model_config_yaml: str, keep_last: int, lora_base: dict | None) -> Path:
    """Collective second half of save_checkpoint: rank 0's small files, the digests, the manifest, the rename."""
    rank = dist.get_rank()
    ckpt_dir = final_dir.parent
    # every rank's files are written and fsync'd by their writers once this collective returns
    root = _rank0_step(tmp_dir, _write_small_files, tmp_dir, step, model_chunks, opt_param_scheduler, pool_entries,
                       rng_entries, pool_shard_index, trainer_state, config_yaml, model_config_yaml)
    if rank == 0 and lora_base is not None:
        root[BASE_KEY] = lora_base
    names = _broadcast_from_rank0(list_files(tmp_dir) if rank == 0 else None)
    digests = _all_gather(digest_files(tmp_dir, my_share(names, rank, dist.get_world_size())))
    _rank0_step(tmp_dir, _seal_and_publish, tmp_dir, final_dir, root, digests)
    if rank == 0:
        L.update_latest_pointer(ckpt_dir, final_dir.name)
        _VERIFIED.add(final_dir.resolve())
        L.apply_retention(ckpt_dir, keep_last, final_dir, verified=_VERIFIED)
    dist.barrier()
    return final_dir


# ----------------------------------------------------------------------------- load


def load_checkpoint(
    path: str | Path,
    *,
    model_chunks: list,
    model_config: ModelConfig,
    optimizer=None,
    opt_param_scheduler=None,
    load_rng: bool = True,
    load_pool: bool = True,
    allow_model_changes: Sequence[str] = (),
) -> LoadedCheckpoint:
    """Load a trainer checkpoint into this layout (any TP/PP/DP). Collective.

    Order: verify every file (size + sha256, streaming, split over the ranks: verify_checkpoint) ->
    manifest + checksums + architecture check + pool shards (cheap, fail early with the file
    named) -> model/optimizer via dist_checkpointing -> LR scheduler (progress from the checkpoint,
    schedule from the config: scheduler_state.py) -> RNG (only when the process layout is identical;
    otherwise a warning, and the caller's fresh seeding stays).
    """
    path = Path(path)
    root = verify_checkpoint(path)
    files = root["files"]
    model_config_yaml = read_verified(path / MODEL_CONFIG_FILE, files[MODEL_CONFIG_FILE]).decode("utf-8")
    check_model_compatible(model_config_yaml, model_config, str(path), allow_model_changes)
    current = process_layout()  # an older checkpoint without EP/ETP: compared on what it records (RNG below)
    if optimizer is not None:
        check_expert_layout(root["layout"], current, str(path))
    trainer_state = json.loads(read_verified(path / TRAINER_STATE_FILE, files[TRAINER_STATE_FILE]))
    config_yaml = None
    if RUN_CONFIG_FILE in files:
        config_yaml = read_verified(path / RUN_CONFIG_FILE, files[RUN_CONFIG_FILE]).decode("utf-8")
    pool_shards = read_pool_shards(path / POOL_SUBDIR, files[POOL_MANIFEST_FILE]) if load_pool else []
    scheduler_state = None
    if opt_param_scheduler is not None and SCHEDULER_FILE in files:
        scheduler_state = json.loads(read_verified(path / SCHEDULER_FILE, files[SCHEDULER_FILE]))

    config_groups = config_group_values(optimizer) if optimizer is not None else None
    if BASE_KEY in root:
        load_lora_base(root[BASE_KEY], model_chunks, str(path))
    load_model_and_optimizer(path / MODEL_SUBDIR, model_chunks, optimizer)
    if config_groups is not None:
        reapply_config_group_values(optimizer, config_groups)  # the config's LR / Adam settings, not the saved
    if scheduler_state is not None:
        restore_scheduler(opt_param_scheduler, scheduler_state)  # the changes are reported by config/resume_changes.py

    rng_restored = False
    if load_rng:
        if all(root["layout"].get(k, v) == v for k, v in current.items()) and set(root["layout"]) <= set(current):
            rank = dist.get_rank()
            restore_rng_state(path / STATE_SUBDIR / RNG_SUBDIR, rank, root["rng"][str(rank)]["sha256"])
            rng_restored = True
        else:
            warnings.warn(
                f"checkpoint {path} was written with layout {root['layout']}, this run is {current}: "
                "RNG states not restored (fresh seeding kept)",
                stacklevel=2,
            )
    return LoadedCheckpoint(
        path=path,
        step=int(root["step"]),
        trainer_state=trainer_state,
        pool_shards=pool_shards,
        config_yaml=config_yaml,
        model_config_yaml=model_config_yaml,
        rng_restored=rng_restored,
        lora_base=root.get(BASE_KEY),
    )
