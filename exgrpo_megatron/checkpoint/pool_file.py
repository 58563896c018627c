"""A response store as one file: written by one run (`experience.pool_file_out`), read by another at start-up as its
initial store (`experience.pool_file_in`): replay from a previous run (RLEP).

The file is a safetensors blob of the merged store state (every DP shard's questions, response_store.py) whose header
metadata holds one JSON object, `pool_file`:

    format, format_version    what wrote it (this code reads version <= POOL_FILE_VERSION)
    content_sha256            sha256 over every array's name, dtype, shape and bytes, in name order
    vocab_size, tokenizer     the model's vocabulary size and the tokenizer's fingerprint (data/token_cache.py):
                              stored token ids mean the same tokens only under the same vocabulary
    questions_sha256          sha256 over (qid, prompt token ids) of the stored questions: a qid means the same
                              question only in the same training data
    written_at_step           the writing run's step (informational)

A read checks all of them against the reading run; any mismatch, a missing or unparsable file, or a checksum that
does not match stops the run at start-up (`PoolFileError` -> exit 2 naming `experience.pool_file_in`). The loaded
responses count as collected at step 0 of the reading run (its staleness bound counts from there).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from exgrpo_megatron.checkpoint.files import fsync_path, write_bytes_durable
from exgrpo_megatron.experience.response_store import ResponseStore

POOL_FILE_FORMAT = "exgrpo_response_pool"
POOL_FILE_VERSION = 1
_META_KEY = "pool_file"


class PoolFileError(ValueError):
    """A pool file that cannot be read, is corrupt, or was written for another model or question set."""


def content_sha256(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def questions_sha256(qids: Sequence[int], prompt_ids: Any) -> str:
    """sha256 over (qid, prompt token ids) of the given questions; `prompt_ids(qid)` -> that question's ids (KeyError:
    not in the data set)."""
    h = hashlib.sha256()
    for q in qids:
        h.update(np.asarray([q, *prompt_ids(int(q))], dtype=np.int64).tobytes() + b"\n")
    return h.hexdigest()


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state holding every shard's questions, by qid (the shards own disjoint questions)."""
    per_q: list[tuple[int, int, int]] = []  # (qid, shard, index in shard)
    for s, state in enumerate(states):
        per_q.extend((int(q), s, i) for i, q in enumerate(state["arrays"]["qids"].tolist()))
    per_q.sort()
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("qids", "counts", "lengths", "steps", "rewards",
                                                        "token_ids", "logprobs")}
    for qid, s, i in per_q:
        a = states[s]["arrays"]
        r_off = np.concatenate([[0], np.cumsum(a["counts"])]).astype(np.int64)
        t_off = np.concatenate([[0], np.cumsum(a["lengths"])]).astype(np.int64)
        lo, hi = int(r_off[i]), int(r_off[i + 1])
        parts["qids"].append(np.asarray([qid], np.int64))
        parts["counts"].append(a["counts"][i:i + 1])
        for key in ("lengths", "steps", "rewards"):
            parts[key].append(a[key][lo:hi])
        for key in ("token_ids", "logprobs"):
            parts[key].append(a[key][int(t_off[lo]):int(t_off[hi])])
    template = states[0]["arrays"] if states else None
    arrays = {k: (np.concatenate(v) if v else np.zeros(0, template[k].dtype if template else np.int64))
              for k, v in parts.items()}
    meta = dict(states[0]["meta"]) if states else {}
    meta.update(dp_rank=0, dp_size=1)
    return {"arrays": arrays, "meta": meta}


def write_pool_file(path: str | Path, state: dict[str, Any], *, vocab_size: int, tokenizer: str, prompt_ids: Any,
                    step: int) -> None:
    """Write a merged store state durably (a temporary name, then renamed)."""
    from safetensors.numpy import save

    arrays = {k: np.ascontiguousarray(v) for k, v in state["arrays"].items()}
    header = {"format": POOL_FILE_FORMAT, "format_version": POOL_FILE_VERSION,
              "content_sha256": content_sha256(arrays), "vocab_size": int(vocab_size), "tokenizer": tokenizer,
              "questions_sha256": questions_sha256(arrays["qids"].tolist(), prompt_ids),
              "written_at_step": int(step), "store": state["meta"]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write_bytes_durable(tmp, save(arrays, metadata={_META_KEY: json.dumps(header, sort_keys=True)}))
    os.replace(tmp, path)
    fsync_path(path.parent)


def _header(data: bytes) -> dict[str, Any]:
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + n])["__metadata__"]
    return dict(json.loads(meta[_META_KEY]))


def read_pool_file(path: str | Path, *, vocab_size: int, tokenizer: str, prompt_ids: Any) -> dict[str, Any]:
    """The merged store state of a pool file, verified (module docstring); PoolFileError saying what is wrong."""
    from safetensors.numpy import load

    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise PoolFileError(f"cannot read {path}: {err.strerror}") from None
    try:
        header, arrays = _header(data), load(data)
    except Exception as err:  # safetensors / JSON parse errors, a header without the pool file's metadata
        raise PoolFileError(f"{path} is not a readable pool file ({type(err).__name__}: {err})") from None
    if header.get("format") != POOL_FILE_FORMAT or not isinstance(header.get("format_version"), int):
        raise PoolFileError(f"{path} is not a pool file (format {header.get('format')!r})")
    if header["format_version"] > POOL_FILE_VERSION:
        raise PoolFileError(f"{path} has format version {header['format_version']}; this code reads "
                            f"<= {POOL_FILE_VERSION}")
    if content_sha256(arrays) != header.get("content_sha256"):
        raise PoolFileError(f"{path} is corrupt: its content does not match its checksum")
    if header.get("vocab_size") != vocab_size or header.get("tokenizer") != tokenizer:
        raise PoolFileError(f"{path} was written for another vocabulary (vocab_size {header.get('vocab_size')}, "
                            f"this model {vocab_size}; or another tokenizer): its token ids mean other tokens")
    try:
        questions = questions_sha256(arrays["qids"].tolist(), prompt_ids)
    except KeyError as err:
        raise PoolFileError(f"{path} holds a question this run's training data lacks ({err})") from None
    if questions != header.get("questions_sha256"):
        raise PoolFileError(f"{path} was written for other training questions (their prompts differ)")
    return {"arrays": arrays, "meta": header["store"]}


def export_store(store: ResponseStore, path: str | Path, *, is_writer: bool, vocab_size: int, tokenizer: str,
                 prompt_ids: Any, step: int) -> None:
    """Write the whole store (every DP shard, gathered: a collective over the store's DP group) to `path`; only the
    rank with `is_writer` writes."""
    states = store.all_states()
    if is_writer:
        write_pool_file(path, merge_states(states), vocab_size=vocab_size, tokenizer=tokenizer,
                        prompt_ids=prompt_ids, step=step)


def import_store(store: ResponseStore, path: str | Path, *, vocab_size: int, tokenizer: str, prompt_ids: Any) -> None:
    """Fill the store with the questions it owns from a verified pool file (collected at step 0 of this run)."""
    state = read_pool_file(path, vocab_size=vocab_size, tokenizer=tokenizer, prompt_ids=prompt_ids)
    store.load_state_dicts([state], step=lambda saved: 0)
