"""Experience-pool shards on disk: one safetensors file per DP replica + one JSON manifest.

    pool/shard_00000_of_00002.safetensors   arrays of DP replica 0 (written by its tp0/pp0 rank)
    pool/shard_00001_of_00002.safetensors
    pool/manifest.json                      {"format_version", "dp_size", "shards": [{"dp_rank", "file",
                                              "sha256", "arrays": {name: {"shape", "dtype"}}, "meta": {...}}]}

The pool's state is whatever `dict[str, np.ndarray]` + JSON-able metadata dict its owner hands us;
nothing here knows the pool's internals. Loading returns every shard, so a run restarted with another
DP size can re-route entries to their new owners.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from exgrpo_megatron.checkpoint.files import (
    FORMAT_VERSION,
    CheckpointFormatError,
    check_format_version,
    numpy_arrays_to_safetensors,
    read_verified,
    safetensors_to_numpy_arrays,
    write_bytes_durable,
    write_json_durable,
)

POOL_SUBDIR = "pool"
POOL_MANIFEST = "manifest.json"

PoolShard = tuple[dict[str, np.ndarray], dict]


def shard_file_name(dp_rank: int, dp_size: int) -> str:
    return f"shard_{dp_rank:05d}_of_{dp_size:05d}.safetensors"


def write_pool_shard(pool_dir: Path, shard: PoolShard, dp_rank: int, dp_size: int) -> dict:
    """Write one shard durably; return its manifest entry (file name, sha256, array schema, meta)."""
    arrays, meta = shard
    try:
        meta_json = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as err:
        raise TypeError(f"pool shard metadata must be JSON-serialisable: {err}") from err
    data, schema = numpy_arrays_to_safetensors(arrays)
    name = shard_file_name(dp_rank, dp_size)
    sha = write_bytes_durable(pool_dir / name, data)
    return {"dp_rank": dp_rank, "file": name, "sha256": sha, "bytes": len(data), "arrays": schema, "meta": meta_json}


def check_shard_entries(entries: list[dict], dp_size: int) -> list[dict]:
    """Every DP replica contributed exactly one shard, or none did (no pool). Sorted by dp_rank."""
    ranks = sorted(e["dp_rank"] for e in entries)
    if ranks and ranks != list(range(dp_size)):
        raise ValueError(f"pool shards were given for dp ranks {ranks}; expected one per rank 0..{dp_size - 1}")
    return sorted(entries, key=lambda e: e["dp_rank"])


def write_pool_manifest(pool_dir: Path, entries: list[dict], dp_size: int) -> str:
    manifest = {"format_version": FORMAT_VERSION, "dp_size": dp_size, "shards": entries}
    return write_json_durable(pool_dir / POOL_MANIFEST, manifest)


def read_pool_shards(pool_dir: Path, manifest_sha256: str) -> list[PoolShard]:
    """All shards in dp_rank order, each verified against the manifest's sha256, shapes and dtypes."""
    manifest_path = pool_dir / POOL_MANIFEST
    manifest = json.loads(read_verified(manifest_path, manifest_sha256))
    check_format_version(manifest.get("format_version"), manifest_path)
    shards: list[PoolShard] = []
    for entry in manifest["shards"]:
        path = pool_dir / entry["file"]
        data = read_verified(path, entry["sha256"])
        try:
            arrays = safetensors_to_numpy_arrays(data, entry["arrays"], path)
        except CheckpointFormatError:
            raise
        except Exception as err:  # safetensors header parse errors
            raise CheckpointFormatError(f"cannot decode pool shard {path}: {err}") from err
        shards.append((arrays, entry["meta"]))
    return shards


def is_pool_writer() -> bool:
    """The tp0 / pp0 / cp0 rank of each DP replica owns (and writes) that replica's pool shard."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_pipeline_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def pool_nbytes(shard: PoolShard | None) -> int:
    if shard is None:
        return 0
    return int(sum(np.asarray(a).nbytes for a in shard[0].values()))
