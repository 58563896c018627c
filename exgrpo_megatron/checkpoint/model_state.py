"""Model chunks + optimizer <-> megatron-core dist_checkpointing (torch_dist), reshardable over TP/PP/DP.

The UNWRAPPED GPTModel chunks are checkpointed (DDP's sharded_state_dict keys carry a "module."
prefix): key "model" for one chunk, "model0", "model1", ... for virtual pipeline stages. Tensors are
stored under global sharded keys, so a checkpoint written at one layout loads at another.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from multiprocessing.managers import SyncManager
from pathlib import Path

from exgrpo_megatron.checkpoint.compat import check_padded_vocab
from exgrpo_megatron.checkpoint.files import CheckpointFormatError
from exgrpo_megatron.distributed.lifetime import die_with_parent, parent_token
from exgrpo_megatron.model.param_layout import is_adapter


def unwrapped(model_chunks: list) -> list:
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model_chunks))


def model_keys(n_chunks: int) -> list[str]:
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


def _optimizer_kwargs(optimizer) -> dict:
    """DistributedOptimizer needs a reshardable format."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(isinstance(o, DistributedOptimizer) for o in inner):
        return {"metadata": {"distrib_optim_sharding_type": "fully_reshardable"}}
    return {}


def sharded_state_dict(model_chunks: list, optimizer, is_loading: bool, adapters_only: bool = False) -> dict:
    """`adapters_only`: the model's LoRA adapters alone (checkpoint/lora_base.py: the base is named, not copied)."""
    modules = unwrapped(model_chunks)
    state = {key: module.sharded_state_dict() for key, module in zip(model_keys(len(modules)), modules, strict=True)}
    if adapters_only:
        state = {key: {k: v for k, v in sd.items() if is_adapter(k)} for key, sd in state.items()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, **_optimizer_kwargs(optimizer))
    return state


def padded_vocab(model_chunks: list) -> int | None:
    return getattr(unwrapped(model_chunks)[0], "vocab_size", None)


def checkpoint_padded_vocab(model_dir: Path) -> int | None:
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(model_dir))
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in metadata:
            return int(metadata[key].global_shape[0])
    return None


_RESULTS_MANAGER: SyncManager | None = None


def _results_server_init(parent_pid: int, kernel: bool) -> None:
    """Runs in the results-queue server process: survive preemption signals sent to the whole process
    group (Slurm signals every process of a step), but die with the training process however it ends
    (the kernel's parent-death SIGKILL, distributed/lifetime.py; at once if it is already gone)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent_pid, kernel=kernel)


def ensure_signal_proof_save_workers() -> None:
    """megatron-core 0.16's torch_dist writer reports through a queue served by a multiprocessing
    Manager process that it starts once per process ('spawn'). Slurm's SIGTERM / SIGUSR1 reach that
    process too and kill it, after which every save -- including the preemption save -- fails with
    BrokenPipeError. Serve the queue from our own Manager that ignores those signals instead
    (recreated if it died)."""
    global _RESULTS_MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        return  # another megatron version: nothing to replace
    process = getattr(_RESULTS_MANAGER, "_process", None)
    if _RESULTS_MANAGER is not None and process is not None and process.is_alive():
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_results_server_init, initargs=parent_token())
    _RESULTS_MANAGER = manager
    filesystem_async._results_queue = manager.Queue()


def save_model_and_optimizer(model_dir: Path, model_chunks: list, optimizer, adapters_only: bool = False) -> None:
    """Collective; `model_dir` must exist. `optimizer` None writes weights only; `adapters_only`: of the model
    only the LoRA adapters (the optimizer has no other state then)."""
    from megatron.core import dist_checkpointing

    ensure_signal_proof_save_workers()
    dist_checkpointing.save(sharded_state_dict(model_chunks, optimizer, is_loading=False, adapters_only=adapters_only),
                            str(model_dir))


def load_model_and_optimizer(model_dir: Path, model_chunks: list, optimizer) -> None:
    """Collective; `optimizer` None loads weights only (any extra "optimizer" key on disk is ignored). LoRA
    (model/lora.py): base weights without adapters load into an adapted model weights-only (the adapters keep
    their initial values: `checkpoint.init_from` a base model); a checkpoint with adapters is refused by a model
    without them (its weights alone are not the trained policy). A checkpoint of the adapters alone
    (checkpoint/lora_base.py) loads them (and the optimizer state) over the base loaded before."""
    from megatron.core import dist_checkpointing

    check_padded_vocab(checkpoint_padded_vocab(model_dir), padded_vocab(model_chunks), str(model_dir))
    saved = dist_checkpointing.load_tensors_metadata(str(model_dir))
    saved_adapters = any(is_adapter(k) for k in saved)
    adapters_only = saved_adapters and all(is_adapter(k) or k.startswith("optimizer") for k in saved)
    request = sharded_state_dict(model_chunks, optimizer, is_loading=True, adapters_only=adapters_only)
    keys = model_keys(len(model_chunks))
    model_adapters = any(is_adapter(k) for key in keys for k in request[key])
    if saved_adapters and not model_adapters:
        raise CheckpointFormatError(f"{model_dir} holds LoRA adapters: load it with the run's lora settings "
                                    "(a model without adapters would silently be the base model)")
    base_only = model_adapters and not saved_adapters
    if base_only and optimizer is not None:
        raise CheckpointFormatError(f"{model_dir} has no LoRA adapters: a LoRA run cannot resume a full "
                                    "fine-tuning checkpoint (start from its weights with checkpoint.init_from)")
    if base_only:
        for key in keys:
            request[key] = {k: v for k, v in request[key].items() if not is_adapter(k)}
    loaded = dist_checkpointing.load(request, str(model_dir))
    for key, module in zip(keys, unwrapped(model_chunks), strict=True):
        result = module.load_state_dict(loaded[key], strict=not (base_only or adapters_only))
        missing_ok = (lambda k: not is_adapter(k)) if adapters_only else is_adapter
        if (base_only or adapters_only) and (result.unexpected_keys or not all(map(missing_ok, result.missing_keys))):
            raise CheckpointFormatError(f"{model_dir}: keys that do not match the model: {result}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])


def local_param_bytes(model_chunks: list) -> int:
    """Parameter + Adam state bytes of this rank's chunks: the weight, two fp32 moments, and an fp32
    master copy when the weights are 16-bit."""
    total = 0
    for module in unwrapped(model_chunks):
        for p in module.parameters():
            master = 4 if p.element_size() < 4 else 0
            total += p.numel() * (p.element_size() + 8 + master)
    return total
