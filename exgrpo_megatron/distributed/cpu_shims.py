"""Every CPU compatibility shim for megatron-core 0.16, in one place.

`apply()` is a no-op when CUDA is available, so the same code runs Transformer Engine and NCCL on
GPU. On CPU it must run before megatron-core's inference modules are imported (one of them imports
`torch.cuda.nvtx` at import time). Each shim names the first failure seen without it
(megatron-core assumes CUDA in a few places). It also filters megatron-core's known-harmless CPU
warnings (`cpu_warnings`), so call it before importing megatron-core modules (the trainer is imported
after it in `train.main`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from exgrpo_megatron.distributed.cpu_warnings import filter_known_cpu_warnings

_APPLIED = False

_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor",
)


def _cpu_device(device):
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(factory):
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    wrapped.__wrapped__ = factory
    return wrapped


class _NullStream:
    def __init__(self, *a, **k): ...
    def wait_event(self, *a, **k): ...
    def wait_stream(self, *a, **k): ...
    def synchronize(self): ...
    def record_event(self, *a, **k): return _WallClockEvent()


class _WallClockEvent:
    def __init__(self, *a, **k):
        self.t = 0.0
    def record(self, *a, **k): self.t = time.perf_counter()
    def synchronize(self): ...
    def wait(self, *a, **k): ...
    def query(self): return True
    def elapsed_time(self, other): return (other.t - self.t) * 1000.0


def apply() -> bool:
    """Patch torch/megatron for CPU. Returns True when the shims are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    _APPLIED = True
    filter_known_cpu_warnings()  # megatron-core's "Apex/TE not installed" fallbacks are the CPU path (module doc)

    cuda: Any = torch.cuda  # the shims replace typed torch functions with CPU stand-ins
    tensor_class: Any = torch.Tensor
    # RoPE moves inv_freq to torch.cuda.current_device() on every forward.
    cuda.current_device = lambda: torch.device("cpu")
    # Hard-coded device="cuda" in pipeline schedules, clip_grads, found_inf, causal masks.
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    tensor_class.cuda = lambda self, *a, **k: self
    tensor_class.pin_memory = lambda self, *a, **k: self
    # clip_grads / DistributedOptimizer assert param.type() == 'torch.cuda.FloatTensor'.
    plain_type = torch.Tensor.type

    def cuda_named_type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None:
            t = plain_type(self)
            return t if t.startswith("torch.cuda.") else t.replace("torch.", "torch.cuda.", 1)
        return plain_type(self, dtype, non_blocking, **kw)

    tensor_class.type = cuda_named_type
    # p2p, dist_checkpointing preload and inference call synchronize/streams/events/NVTX.
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.Event = _WallClockEvent
    import torch.cuda.nvtx as nvtx

    for name in ("range_push", "range_pop", "mark"):
        setattr(nvtx, name, lambda *a, **k: None)

    # model_parallel_cuda_manual_seed and attention's tracker.fork() need a CUDA RNG.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    def add_cpu_rng_state(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mrandom.CudaRNGStatesTracker.add = add_cpu_rng_state
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)

    # Inference pipeline send/recv asserts tensor.is_cuda.
    import megatron.core.inference.communication_utils as comm_utils

    comm_utils._is_cuda = lambda tensor: None
    _apply_moe_shims(cuda)
    return True


class _NullStreamContext:
    def __init__(self, *a, **k): ...
    def __enter__(self): return None
    def __exit__(self, *exc): return False


def _apply_moe_shims(cuda: Any) -> None:
    """Mixture-of-experts layers (model/moe.py) on CPU, over gloo."""
    from megatron.core.transformer.moe import moe_utils, router

    # The router's gating GEMM (moe_utils.RouterGatingLinearFunction) tests `te_general_gemm is not None`, but the
    # name is only bound when Transformer Engine imports: `NameError: name 'te_general_gemm' is not defined` on the
    # first MoE forward. None selects its torch matmul path.
    for module in (moe_utils, router):
        if not hasattr(module, "te_general_gemm"):
            module.te_general_gemm = None
    # The alltoall token dispatcher creates a side stream for its device-to-host copies in __init__
    # (`RuntimeError: torch.cuda.Stream requires CUDA support`), enters it with `torch.cuda.stream(...)` and waits on
    # the event the stream records (`self.d2h_event.synchronize()`: 'NoneType' object has no attribute
    # 'synchronize' with a stream that records none): a null stream whose record_event returns a (wall-clock) event.
    cuda.Stream = _NullStream
    cuda.stream = _NullStreamContext
    # The alltoall dispatcher's split sizes become numpy arrays only when `maybe_move_tensor_to_cpu(..., as_numpy=True)`
    # moves them off a GPU; CPU tensors stay tensors and torch's all_to_all_single refuses them
    # (`TypeError: all_to_all_single(): incompatible function arguments`): convert them as on GPU.
    from megatron.core.transformer.moe import token_dispatcher

    moved = moe_utils.maybe_move_tensor_to_cpu

    def to_cpu_as_on_gpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return moved(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu_as_on_gpu
