"""Streaming reads of HF safetensors directories and sharded safetensors writes (HF index format)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


class SafetensorsSource:
    """Name -> tensor access to an HF directory (sharded index or single file), memory-mapped."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
            with safe_open(os.path.join(hf_dir, SINGLE_FILE), framework="pt") as f:
                self.weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            bins = [n for n in os.listdir(hf_dir) if n.endswith(".bin")]
            raise FileNotFoundError(f"{hf_dir}: no {INDEX_FILE} or {SINGLE_FILE}"
                                    + (f" (found {bins}: convert .bin weights to safetensors first)" if bins else ""))
        self.hf_dir = hf_dir
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.hf_dir}: tensor {name!r} not found")
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(os.path.join(self.hf_dir, fname), framework="pt")
        return self._handles[fname].get_tensor(name)

    def dtype(self) -> torch.dtype:
        return self.get(next(iter(self.weight_map))).dtype


class ShardedSafetensorsWriter:
    """Accumulate tensors and flush `model-0000i-of-0000N.safetensors` shards of at most `shard_bytes`."""

    def __init__(self, out_dir: str, shard_bytes: int):
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        os.makedirs(out_dir, exist_ok=True)
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.shard_bytes:
            self._flush()
        # a view into a larger tensor (e.g. one of q/k/v) would make safetensors save the whole storage
        shares_storage = tensor.untyped_storage().nbytes() != nbytes or not tensor.is_contiguous()
        self._buf[name] = tensor.contiguous().clone() if shares_storage else tensor
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._buf:
            return
        tmp = os.path.join(self.out_dir, f".shard-{len(self._shards):05d}.safetensors")
        save_file(self._buf, tmp, metadata={"format": "pt"})
        self._shards.append(list(self._buf))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, rename to HF names, write the index (or a single model.safetensors)."""
        self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(os.path.join(self.out_dir, ".shard-00000.safetensors"), os.path.join(self.out_dir, SINGLE_FILE))
            return [SINGLE_FILE]
        weight_map, files = {}, []
        for i, names in enumerate(self._shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f".shard-{i:05d}.safetensors"), os.path.join(self.out_dir, fname))
            weight_map.update({k: fname for k in names})
            files.append(fname)
        with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return files


def copy_tokenizer_files(src_dir: str, out_dir: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
            copied.append(name)
    return copied
