"""Per-rank RNG state on disk, without pickle.

    state/rng/rank_00003.safetensors   torch tensors: CPU generator, CUDA generators, megatron tracker states
    state/rng/rank_00003.json          python `random` and numpy MT19937 states (plain ints) + the sha256
                                       of the .safetensors file

Restored only when the process layout (world size, TP, PP, DP, CP, VPP) is identical, because the
rank -> role mapping (which TP/DP rank a stream belongs to) is meaningless otherwise.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from exgrpo_megatron.checkpoint.files import (
    FORMAT_VERSION,
    check_format_version,
    read_verified,
    write_bytes_durable,
    write_json_durable,
)

RNG_SUBDIR = "rng"
_TRACKER_PREFIX = "megatron_tracker/"
_CUDA_PREFIX = "cuda/"


def _rng_file_stem(rank: int) -> str:
    return f"rank_{rank:05d}"


def _megatron_tracker():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def capture_rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"torch_cpu": torch.get_rng_state().clone()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{_CUDA_PREFIX}{index}"] = state.cpu().clone()
    for name, state in _megatron_tracker().get_states().items():
        tensors[_TRACKER_PREFIX + name] = state.cpu().clone()
    return tensors


def capture_rng_scalars() -> dict:
    version, mt_state, gauss_next = random.getstate()
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python_random": {"version": version, "state": list(mt_state), "gauss_next": gauss_next},
        "numpy_random": {
            "bit_generator": bit_generator,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
    }


def write_rng_state(rng_dir: Path, rank: int) -> dict:
    """Write this rank's RNG streams; return {"json": name, "sha256": sha of the json} for the root manifest."""
    from safetensors.torch import save

    stem = _rng_file_stem(rank)
    tensor_sha = write_bytes_durable(rng_dir / f"{stem}.safetensors", save(capture_rng_tensors()))
    record = {"format_version": FORMAT_VERSION, "rank": rank, "tensors_sha256": tensor_sha, **capture_rng_scalars()}
    return {"json": f"{stem}.json", "sha256": write_json_durable(rng_dir / f"{stem}.json", record)}


def restore_rng_state(rng_dir: Path, rank: int, json_sha256: str) -> None:
    """Restore python, numpy, torch CPU/CUDA and megatron tracker streams of `rank` (checksums verified)."""
    from safetensors.torch import load

    stem = _rng_file_stem(rank)
    json_path = rng_dir / f"{stem}.json"
    record = json.loads(read_verified(json_path, json_sha256))
    check_format_version(record.get("format_version"), json_path)
    tensors = load(read_verified(rng_dir / f"{stem}.safetensors", record["tensors_sha256"]))

    restore_rng_streams(tensors, record)


def restore_rng_streams(tensors: dict[str, torch.Tensor], scalars: dict) -> None:
    """Set every stream from `capture_rng_tensors()` / `capture_rng_scalars()` (or their saved copies)."""
    py = scalars["python_random"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npr = scalars["numpy_random"]
    keys = np.asarray(npr["keys"], dtype=np.uint32)
    np.random.set_state((npr["bit_generator"], keys, npr["pos"], npr["has_gauss"], npr["cached_gaussian"]))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith(_CUDA_PREFIX)]
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    tracker_states = {k[len(_TRACKER_PREFIX):]: v for k, v in tensors.items() if k.startswith(_TRACKER_PREFIX)}
    if tracker_states:
        _megatron_tracker().set_states(tracker_states)


@contextmanager
def rng_streams_kept() -> Iterator[None]:
    """Every stream restore_rng_streams sets is as before the block when it ends (work whose draws must not shift
    the run's streams, such as training the warm-start entry that another run would load instead)."""
    tensors, scalars = capture_rng_tensors(), capture_rng_scalars()
    try:
        yield
    finally:
        restore_rng_streams(tensors, scalars)
