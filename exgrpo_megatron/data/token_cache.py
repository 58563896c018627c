"""Tokenised prompt data cached on disk, so a 46k-prompt data set is rendered and tokenised once, not on every start
and every rank.

Key (sha256 over a JSON of): the content hash of every data file in order, the tokenizer's fingerprint
(:func:`tokenizer_fingerprint`: its files, or its fixed vocabulary), the prompt template, ``prompt_key``,
``answer_key``, ``max_prompt_length`` and :data:`CACHE_VERSION`. Any change to one of them is a new key, so
a stale entry is never read; old entries are simply left behind (delete the directory to reclaim them).

Entry ``<cache_dir>/<key>.npz``: the kept examples' token ids flat (int32) with offsets, their qids, and a
JSON blob with the texts, the load's ``DatasetStats`` and its malformed-row list (a cache hit reports the same
counts as the first load). Written to a temporary name and renamed, so a crash mid-write leaves no entry.

A damaged entry (truncated, flipped bytes: numpy's zip members carry CRC-32s, the JSON must parse, the key must
match) is named in a warning and rebuilt by rank 0.

Ranks: rank 0 builds the entry while the others wait at a barrier, then every rank reads it. A rank that
still finds no entry (the cache directory is not shared between nodes) builds the data itself, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from exgrpo_megatron.data.datasets import DatasetStats, PromptDataset, PromptExample, TextEncoder, load_prompt_dataset

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
_TOKENIZER_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")  # not weights


def file_digest(path: str, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: TextEncoder) -> str:
    """What makes a tokenizer's output: an HF tokenizer's files (vocab, merges, config, chat template), or a
    fixed vocabulary (``id_to_token``), with the class name."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    path = getattr(tokenizer, "path", None)
    vocab = getattr(tokenizer, "id_to_token", None)
    if isinstance(path, str) and os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith(_TOKENIZER_FILE_SUFFIXES) and os.path.isfile(os.path.join(path, name)):
                h.update(name.encode() + b"\0" + file_digest(os.path.join(path, name)).encode())
    elif vocab is not None:
        h.update(json.dumps(list(vocab)).encode())
    else:
        raise ValueError(f"token cache: cannot fingerprint a {type(tokenizer).__name__} (no tokenizer dir or "
                         "id_to_token); set data.token_cache_dir to '' to load without the cache")
    return h.hexdigest()


def cache_key(files: Sequence[str], tokenizer: TextEncoder, *, template: str, prompt_key: str, answer_key: str,
              max_prompt_length: int) -> str:
    fields = {"version": CACHE_VERSION, "files": [file_digest(f) for f in files],
              "tokenizer": tokenizer_fingerprint(tokenizer), "template": template, "prompt_key": prompt_key,
              "answer_key": answer_key, "max_prompt_length": max_prompt_length}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def save_entry(dataset: PromptDataset, path: str, key: str) -> None:
    """Write ``dataset`` to ``path`` atomically (temporary file + rename)."""
    examples = list(dataset)
    lengths = np.array([len(ex.prompt_ids) for ex in examples], dtype=np.int64)
    meta = {"key": key, "questions": [ex.question for ex in examples], "answers": [ex.answer for ex in examples],
            "data_sources": [ex.data_source for ex in examples], "stats": asdict(dataset.stats),
            "malformed": [list(m) for m in dataset.malformed]}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        np.savez(fh, ids=np.fromiter((t for ex in examples for t in ex.prompt_ids), dtype=np.int32,
                                     count=int(lengths.sum())),
                 offsets=np.concatenate([[0], np.cumsum(lengths)]), qids=np.array([ex.qid for ex in examples],
                                                                                  dtype=np.int64),
                 meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    os.replace(tmp, path)


def load_entry(path: str, key: str) -> PromptDataset:
    """Read an entry written by :func:`save_entry`; ValueError if it belongs to another key."""
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        if meta.get("key") != key:
            raise ValueError(f"{path}: entry for key {meta.get('key')!r}, expected {key!r}")
        ids, offsets, qids = z["ids"], z["offsets"], z["qids"].tolist()
    examples = [PromptExample(qid, q, a, ids[offsets[i]:offsets[i + 1]].tolist(), s) for i, (qid, q, a, s) in
                enumerate(zip(qids, meta["questions"], meta["answers"], meta["data_sources"], strict=True))]
    return PromptDataset(examples, DatasetStats(**meta["stats"]), [tuple(m) for m in meta["malformed"]])


def read_entry_or_none(path: str, key: str) -> PromptDataset | None:
    """The entry at ``path``, or None when it is missing or damaged (a damaged one is named in a warning)."""
    if not os.path.isfile(path):
        return None
    try:
        return load_entry(path, key)
    except Exception as exc:  # noqa: BLE001 - BadZipFile, EOFError, zlib.error, ValueError, KeyError, OSError...
        print(f"exgrpo-train: token cache entry {path} is damaged ({type(exc).__name__}: {exc}); rebuilding it",
              file=sys.stderr, flush=True)
        return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def cached_prompt_dataset(files: Sequence[str] | str, *, cache_dir: str, tokenizer: TextEncoder, template: str,
                          max_prompt_length: int, prompt_key: str = "prompt",
                          answer_key: str = "reward_model.ground_truth") -> PromptDataset:
    """:func:`load_prompt_dataset` through the cache in ``cache_dir`` (see module doc); ``cache_dir=""``: no cache.
    Every rank of the default process group must call it (rank 0 builds, the others wait)."""
    paths = [files] if isinstance(files, str) else list(files)

    def tokenise() -> PromptDataset:
        return load_prompt_dataset(paths, prompt_key=prompt_key, answer_key=answer_key, tokenizer=tokenizer,
                                   template=template, max_prompt_length=max_prompt_length)

    if not cache_dir:
        return tokenise()
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompt data file {path!r} does not exist")
    start = time.perf_counter()
    key = cache_key(paths, tokenizer, template=template, prompt_key=prompt_key, answer_key=answer_key,
                    max_prompt_length=max_prompt_length)
    entry = os.path.join(cache_dir, f"{key}.npz")
    built, dataset = False, None
    if _rank() == 0:
        dataset = read_entry_or_none(entry, key)
        if dataset is None:
            save_entry(tokenise(), entry, key)
            built = True  # read back below like every rank's, so a first run sees what later ones read
    _barrier()
    if dataset is None:
        dataset = read_entry_or_none(entry, key)
    if dataset is None:  # not shared with rank 0's node, or unreadable: build here
        logger.warning("token cache: cannot read %s; tokenising on this rank", entry)
        dataset = tokenise()
    if _rank() == 0:
        print(f"exgrpo-train: prompt data {paths}: {len(dataset)} prompts "
              f"{'tokenised and cached' if built else 'read from the token cache'} {entry} "
              f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return dataset
