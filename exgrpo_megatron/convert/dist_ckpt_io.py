"""Stream tensors into / out of a megatron-core `torch_dist` checkpoint without building the model.

Layout written (identical to what `dist_checkpointing.save({"model": gpt.sharded_state_dict()})` writes at
TP=1/PP=1, checked in tests/test_convert.py): PyTorch DCP files (`.metadata` + `*.distcp`) whose keys are
megatron's sharded keys. Per-layer tensors are one global tensor per parameter with a leading layer axis,
key `decoder.layers.<suffix>` (norms under their TE names, e.g. `input_layernorm.weight` is stored as
`decoder.layers.self_attention.linear_qkv.layer_norm_weight`), one chunk per layer; each layer's
`_extra_state` is a bytes object `<key>/shard_<layer>_<num_layers>`. Plus megatron's `metadata.json`
and an empty `common.pt`. megatron's loader reshards this to any TP/PP layout.

Writing goes through `torch.distributed.checkpoint.save` with a planner that materialises each chunk
only when the writer asks for it (`resolve_data`), one file per item so the writer never holds more
than one tensor; reading requests arbitrary regions (one layer, the unpadded vocabulary rows).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from exgrpo_megatron.model.param_layout import LOCAL_TO_TE, canonical_name, split_expert_name, split_layer_name

LAYER_EXTRA_STATE_MODULES = (
    "self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2",
)
MEGATRON_METADATA = {
    "sharded_backend": "torch_dist", "sharded_backend_version": 1,
    "common_backend": "torch", "common_backend_version": 1,
}


def sharded_key(name: str) -> tuple[str, tuple[int, ...]]:
    """(dist-checkpoint key, the leading axes' indices) of a megatron parameter name: () outside the decoder
    layers, (layer,) for a layer's tensor, (layer, expert) for one expert's (megatron stores the experts of
    all layers as one tensor `decoder.layers.mlp.experts.experts.<rest>` of [layers, experts, ...])."""
    name = canonical_name(name)
    layer, suffix = split_layer_name(name)
    if layer is None:
        return name, ()
    expert, generic = split_expert_name(suffix)
    if expert is not None:
        return "decoder.layers.mlp.experts.experts." + generic.split("*.", 1)[1], (layer, expert)
    return f"decoder.layers.{LOCAL_TO_TE.get(suffix, suffix)}", (layer,)


@dataclass(frozen=True)
class ChunkSpec:
    """One stored chunk: `produce()` returns a tensor of `shape` placed at `offset` of `global_shape`."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


def layer_extra_state_keys(num_layers: int, num_experts: int = 0) -> list[str]:
    """The ShardedObject unique keys megatron writes for each layer's (and each expert's) empty `_extra_state`."""
    if not num_experts:
        return [f"decoder.layers.{m}._extra_state/shard_{i}_{num_layers}"
                for i in range(num_layers) for m in LAYER_EXTRA_STATE_MODULES]
    attention = [m for m in LAYER_EXTRA_STATE_MODULES if m.startswith("self_attention.")]
    return ([f"decoder.layers.{m}._extra_state/shard_{i}_{num_layers}" for i in range(num_layers) for m in attention]
            + [f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{e}_{num_layers}.{num_experts}"
               for i in range(num_layers) for e in range(num_experts) for fc in ("linear_fc1", "linear_fc2")])


def _empty_extra_state() -> io.BytesIO:
    # megatron serialises the list of the local ShardedObjects' data; the local spec's is None.
    buf = io.BytesIO()
    torch.save([None], buf)
    return buf


class _StreamingSavePlanner(DefaultSavePlanner):
    def __init__(self, chunks: list[ChunkSpec], object_keys: list[str], on_item: Callable[[str], None] | None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, c.offset): c for c in chunks}
        self._object_keys = object_keys
        self._on_item = on_item

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.mappings, self.is_coordinator = {}, {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self._object_keys]
        for c in self._chunks.values():
            offsets = torch.Size(c.offset)
            items.append(WriteItem(
                index=MetadataIndex(c.key, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(c.shape)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            ))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return _empty_extra_state()
        spec = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset or ()))]
        tensor = spec.produce()
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise RuntimeError(f"{spec.key}@{spec.offset}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                               f"planned {spec.shape} {spec.dtype}")
        if self._on_item is not None:
            self._on_item(spec.key)
        return tensor.contiguous()


def write_dist_checkpoint(out_dir: str, chunks: list[ChunkSpec], object_keys: Iterable[str] = (),
                          on_item: Callable[[str], None] | None = None) -> None:
    """Write a megatron torch_dist checkpoint holding `chunks` (+ empty extra-state objects) to `out_dir`."""
    from torch.distributed.checkpoint import FileSystemWriter

    os.makedirs(out_dir, exist_ok=True)
    planner = _StreamingSavePlanner(chunks, list(object_keys), on_item)
    # single_file_per_rank=False: one file per item, so the writer never keeps earlier tensors alive.
    writer = FileSystemWriter(out_dir, single_file_per_rank=False, thread_count=1, sync_files=False)
    dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    torch.save({}, os.path.join(out_dir, "common.pt"))
    import json

    with open(os.path.join(out_dir, "metadata.json"), "w") as f:
        json.dump(MEGATRON_METADATA, f)


# ---------------------------------------------------------------- reading
class _RegionLoadPlanner(LoadPlanner):
    """Loads requested regions (key, offset, destination tensor) of stored global tensors."""

    def __init__(self, requests: list[tuple[str, tuple[int, ...], torch.Tensor]]):
        self._requests = requests
        self._dest: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is None:
            raise ValueError("reading a torch_dist checkpoint needs its metadata")
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, offset, dest in self._requests:
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"checkpoint has no tensor {key!r}")
            if any(o + s > g for o, s, g in zip(offset, dest.shape, md.size, strict=True)):
                raise ValueError(f"{key}: region {offset}+{tuple(dest.shape)} outside stored shape {tuple(md.size)}")
            self._dest[(key, tuple(offset))] = dest
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=dest.shape)
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:  # pragma: no cover - never requested
        raise RuntimeError("bytes objects are not requested")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class DistCheckpointReader:
    """Random access to regions of a megatron torch_dist checkpoint directory, on CPU, no process group."""

    def __init__(self, ckpt_dir: str):
        from torch.distributed.checkpoint import FileSystemReader

        if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
            raise FileNotFoundError(f"{ckpt_dir} is not a torch_dist checkpoint (no .metadata)")
        self.ckpt_dir = ckpt_dir
        self._reader = FileSystemReader(ckpt_dir)
        self.metadata: Metadata = self._reader.read_metadata()

    def tensor_meta(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{self.ckpt_dir}: no tensor {key!r} (model keys present: "
                           f"{sorted(k for k in self.metadata.state_dict_metadata if not k.startswith('optimizer'))})")
        return md

    def read_regions(self, requests: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
                     dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Tensors for (key, offset, shape) regions, in the stored dtype unless `dtype` is given."""
        from torch.distributed.checkpoint import FileSystemReader

        dests = [torch.empty(shape, dtype=dtype or self.tensor_meta(key).properties.dtype)
                 for key, _, shape in requests]
        planner = _RegionLoadPlanner([(k, tuple(o), d) for (k, o, _), d in zip(requests, dests, strict=True)])
        dcp.load({}, storage_reader=FileSystemReader(self.ckpt_dir), planner=planner, no_dist=True)
        return dests

    def read_param(self, name: str, rows: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full (TP=1 layout) megatron parameter `name` (global layer index); `rows` limits dim 0."""
        key, index = sharded_key(name)
        size = tuple(self.tensor_meta(key).size)
        if not index:
            shape = ((rows,) + size[1:]) if rows is not None else size
            return self.read_regions([(key, (0,) * len(size), shape)], dtype)[0]
        if any(i >= n for i, n in zip(index, size, strict=False)):
            raise KeyError(f"{name}: checkpoint stores only {size[:len(index)]} (layers, experts)")
        region = (1,) * len(index) + size[len(index):]
        offset = index + (0,) * (len(size) - len(index))
        return self.read_regions([(key, offset, region)], dtype)[0].reshape(size[len(index):])


class LayeredCheckpointReader(DistCheckpointReader):
    """Several checkpoints read as one, each key from the first that has it: a LoRA checkpoint of the adapters alone
    over the base weights it names (checkpoint/lora_base.py)."""

    def __init__(self, readers: list[DistCheckpointReader]):
        self.readers = readers
        self.ckpt_dir = readers[0].ckpt_dir
        merged = {k: v for r in reversed(readers) for k, v in r.metadata.state_dict_metadata.items()}
        self.metadata = Metadata(state_dict_metadata=merged)

    def read_regions(self, requests: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
                     dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(requests)
        for reader in self.readers:
            mine = [i for i, (key, _, _) in enumerate(requests)
                    if out[i] is None and key in reader.metadata.state_dict_metadata]
            if mine:
                for i, t in zip(mine, reader.read_regions([requests[i] for i in mine], dtype), strict=True):
                    out[i] = t
        missing = [requests[i][0] for i, t in enumerate(out) if t is None]
        if missing:
            raise KeyError(f"{self.ckpt_dir}: no tensor {missing[0]!r}")
        return [t for t in out if t is not None]
