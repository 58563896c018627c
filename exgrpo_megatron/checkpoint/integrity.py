"""Per-file size + sha256 of a whole checkpoint directory, and its verification.

Every file of a checkpoint (megatron's model/optimizer shards and metadata, pool shards, RNG, trainer
and scheduler state, configs) is listed in `checkpoint.json` under "file_digests" as
`{relative path: {"bytes": size, "sha256": hex}}`, computed from the fsync'd files before the atomic
rename. Load re-reads them in 1 MiB chunks (streaming: memory stays flat at any checkpoint size); the
work is split over the ranks (file i goes to rank i mod world) and the ranks agree on the verdict
(checkpointer.verify_checkpoint), so every rank loads the same checkpoint or none.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

import exgrpo_megatron.checkpoint.layout as L
from exgrpo_megatron.checkpoint.files import CheckpointFormatError, check_format_version
from exgrpo_megatron.config.paths import WEIGHTS_MANIFEST

DIGESTS_KEY = "file_digests"
SEAL_KEY = "manifest_sha256"  # sha256 of checkpoint.json's own content (without this key), canonical JSON
_CHUNK = 1 << 20
# resolved paths of the checkpoints this process wrote or verified: retention trusts only these
_VERIFIED: set[Path] = set()


class CheckpointVerificationError(CheckpointFormatError):
    """A checkpoint failed verification: `path` is the checkpoint dir, `file` the first bad file, `reason` why."""

    def __init__(self, path: Path, file: str, reason: str) -> None:
        self.path, self.file, self.reason = Path(path), file, reason
        super().__init__(f"checkpoint {path} failed verification: {Path(path) / file}: {reason}")


def manifest_seal(root: dict) -> str:
    """sha256 of the manifest without its seal (sorted-key JSON): a bit flip that keeps the JSON valid
    (a step number, a digest) is caught too."""
    body = {k: v for k, v in root.items() if k != SEAL_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def file_digest(path: Path) -> dict:
    """{"bytes", "sha256"} of one file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def list_files(root: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Relative POSIX paths of every regular file under `root`, sorted, minus `exclude`."""
    found = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel not in exclude:
                found.append(rel)
    return sorted(found)


def my_share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files rank `rank` hashes or checks: every world_size-th, starting at `rank` (sorted input)."""
    return names[rank::world_size]


def digest_files(root: Path, names: list[str]) -> dict[str, dict]:
    return {name: file_digest(root / name) for name in names}


def check_file(root: Path, name: str, expected: dict) -> str | None:
    """Why file `name` does not match its manifest entry, or None. Size first (cheap), then sha256."""
    path = root / name
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"size {size} bytes, manifest says {expected['bytes']} (truncated or overwritten)"
    actual = file_digest(path)["sha256"]
    if actual != expected["sha256"]:
        return f"sha256 mismatch (corrupted): expected {expected['sha256']}, found {actual}"
    return None


def first_problem(root: Path, digests: dict[str, dict], names: list[str]) -> tuple[str, str] | None:
    """(file, reason) of the first of `names` that fails its check, or None when all verify."""
    for name in names:
        reason = check_file(root, name, digests[name])
        if reason is not None:
            return name, reason
    return None


# ----------------------------------------------------------------------------- collective verification


def read_root_manifest(path: Path) -> dict:
    """checkpoint.json of a checkpoint dir (parsed, format version checked)."""
    manifest_path = path / L.ROOT_MANIFEST
    if not manifest_path.is_file():
        raise CheckpointFormatError(f"{path} is not a complete trainer checkpoint: {L.ROOT_MANIFEST} is missing")
    try:
        root = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"checkpoint manifest is corrupted: {manifest_path}: {err}") from err
    check_format_version(root.get("format_version"), manifest_path)
    return root


def digests_problem(path: Path, root: dict, manifest_name: str, rank: int, world_size: int
                    ) -> tuple[str, str] | None:
    """(file, reason) of the first problem of `path` against a parsed manifest (its seal, then this rank's share
    of the listed files: my_share), or None."""
    digests = root.get(DIGESTS_KEY)
    if root.get(SEAL_KEY) != manifest_seal(root) or not isinstance(digests, dict) or not digests:
        return manifest_name, "its own sha256 does not match its content (corrupted manifest)"
    return first_problem(path, digests, my_share(sorted(digests), rank, world_size))


def first_problem_on_any_rank(problem: tuple[str, str] | None) -> tuple[str, str] | None:
    """Every rank's verdict gathered: the first problem any rank found (all ranks agree), or None."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((p for p in gathered if p is not None), None)


def verify_checkpoint(path: str | Path) -> dict:
    """Collective: check the size and sha256 of every file of checkpoint `path` against its manifest,
    each rank streaming its share of the files; returns the root manifest, or raises the same
    CheckpointVerificationError (first bad file + reason) on every rank."""
    path = Path(path)
    problem: tuple[str, str] | None = None
    root: dict = {}
    try:
        root = read_root_manifest(path)
        if SEAL_KEY not in root and DIGESTS_KEY not in root:
            problem = (L.ROOT_MANIFEST, f"lists no per-file sizes and checksums ({DIGESTS_KEY}); written by an "
                                        "older version, cannot be verified")
        else:
            problem = digests_problem(path, root, L.ROOT_MANIFEST, dist.get_rank(), dist.get_world_size())
    except (CheckpointFormatError, OSError, KeyError, TypeError, AttributeError) as err:
        problem = (L.ROOT_MANIFEST, f"{type(err).__name__}: {err}")
    first = first_problem_on_any_rank(problem)
    if first is not None:
        raise CheckpointVerificationError(path, *first)
    _VERIFIED.add(path.resolve())
    return root


# ----------------------------------------------------------------------------- weights-only directories


def write_weights_manifest(path: str | Path) -> Path:
    """Seal a finished weights-only directory (`model/` + `model_config.yaml`, a converter's output or the
    SFT cache): `manifest.json` with the size + sha256 of every other file, written last and fsync'd."""
    from exgrpo_megatron.checkpoint.files import FORMAT_VERSION, write_json_durable

    path = Path(path)
    names = list_files(path, exclude=(WEIGHTS_MANIFEST,))
    root: dict[str, Any] = {"format_version": FORMAT_VERSION, DIGESTS_KEY: digest_files(path, names)}
    root[SEAL_KEY] = manifest_seal(root)
    target = path / WEIGHTS_MANIFEST
    write_json_durable(target, root)
    return target


def weights_problem(path: Path, rank: int = 0, world_size: int = 1) -> tuple[str, str] | None:
    """(file, reason) of the first problem of a weights-only dir against its manifest, or None; this rank
    hashes its share of the files (my_share)."""
    manifest = path / WEIGHTS_MANIFEST
    if not manifest.is_file():
        return WEIGHTS_MANIFEST, "missing: the directory is not sealed (converters and the SFT warm start write it)"
    try:
        root = json.loads(manifest.read_text(encoding="utf-8"))
        check_format_version(root.get("format_version"), manifest)
        return digests_problem(path, root, WEIGHTS_MANIFEST, rank, world_size)
    except (ValueError, UnicodeDecodeError, CheckpointFormatError, OSError, KeyError, TypeError) as err:
        return WEIGHTS_MANIFEST, f"{type(err).__name__}: {err}"


def verify_weights_dir(path: str | Path) -> None:
    """Collective when a process group is up: every rank checks the dir and all agree; raises
    CheckpointVerificationError (first bad file + reason) on every rank."""
    path = Path(path)
    collective = dist.is_available() and dist.is_initialized()
    problem = weights_problem(path, *((dist.get_rank(), dist.get_world_size()) if collective else (0, 1)))
    if collective:
        problem = first_problem_on_any_rank(problem)
    if problem is not None:
        raise CheckpointVerificationError(path, *problem)
