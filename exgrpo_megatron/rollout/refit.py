"""Full (un-sharded) policy weights for an inference engine that holds its own copy (vLLM refit).

Every rank of a model replica calls `iter_full_param_buckets(chunks, bucket_bytes)` with its model
chunks (one per virtual pipeline stage) and receives the same sequence of buckets of (global
megatron name, full TP=1-layout tensor). Names and sharding come from model/param_layout.py:

- TP: one all-gather per bucket of the flattened local shards over the TP group; each sharded
  parameter is reassembled from the split megatron recorded on it (`tp_split_of_param`; stride 2 is
  SwiGLU's fc1, whose shards are [gate_r; up_r]).
- PP: each stage's buckets (all its VPP chunks, chunk by chunk) are broadcast, flattened, from that
  stage over the PP group, so every stage ends with every weight (vLLM's loaders shard them again
  for their own TP rank).
- Names: the TP=1/PP=1 model's names (`named_global_params`, global layer indices under PP and
  VPP). With tied embeddings the last stage's copy of the embedding (`output_layer.weight`, PP > 1
  only) is skipped; `iter_hf_weight_buckets` emits `lm_head.weight` from the embedding instead
  (vLLM needs it explicitly).

Buckets are consecutive runs of one stage's parameters in `named_parameters()` order, closed as
soon as they reach `bucket_bytes` (or when the dtype changes), so every tensor appears exactly once,
the order is stable, and every bucket but a stage's last is >= the threshold (slime-style flattened
buckets).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.model.param_layout import (
    EMBEDDING,
    named_global_params,
    tp_full_shape,
    tp_split_of_param,
    tp_unshard,
    unwrap_chunk,
)

HF_LM_HEAD_NAME = "lm_head.weight"

# (megatron global name, full TP=1 tensor, ModelConfig) -> [(hf name, tensor)], as convert.hf_mapping.megatron_to_hf
HFConverter = Callable[[str, torch.Tensor, ModelConfig], list[tuple[str, torch.Tensor]]]


def gather_tp_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full tensors of this stage's `params` with ONE all-gather over the TP group."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    splits = [tp_split_of_param(p) for p in params]
    sharded = [i for i, split in enumerate(splits) if split is not None and tp > 1]
    full = [p.detach() for p in params]
    if not sharded:
        return full
    flat = torch.cat([params[i].detach().reshape(-1) for i in sharded])
    gathered = [torch.empty_like(flat) for _ in range(tp)]
    dist.all_gather(gathered, flat, group=ps.get_tensor_model_parallel_group())
    offset = 0
    for i in sharded:
        p = params[i]
        full[i] = tp_unshard([g[offset: offset + p.numel()].view(p.shape) for g in gathered], splits[i])
        offset += p.numel()
    return full


def plan_buckets(sizes_bytes: list[int], bucket_bytes: int, keys: list[object] | None = None) -> list[list[int]]:
    """Consecutive index runs; a run closes when it reaches `bucket_bytes` or before a key change."""
    buckets: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes_bytes):
        key_changed = keys is not None and buckets and keys[buckets[-1][-1]] != keys[i]
        if not buckets or total >= bucket_bytes or key_changed:
            buckets.append([])
            total = 0
        buckets[-1].append(i)
        total += size
    return buckets


def iter_full_param_buckets(chunks: Sequence[torch.nn.Module], bucket_bytes: int
                            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the replica's full weights bucket by bucket, identically on all its TP and PP ranks.
    `chunks`: this rank's model chunks (DDP/Float16Module-wrapped or bare), in virtual stage order."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    local = named_global_params(chunks, tied_copy=False)
    meta = [(name, tp_full_shape(p.shape, tp_split_of_param(p), tp), p.dtype) for name, p in local]
    if pp > 1:
        every_stage: list = [None] * pp
        dist.all_gather_object(every_stage, meta, group=ps.get_pipeline_model_parallel_group())
        pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    else:
        every_stage, pp_ranks = [meta], [dist.get_rank() if dist.is_initialized() else 0]
    my_stage = ps.get_pipeline_model_parallel_rank()
    device = local[0][1].device
    for stage, stage_meta in enumerate(every_stage):
        sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in stage_meta]
        for bucket in plan_buckets(sizes, bucket_bytes, keys=[dtype for _, _, dtype in stage_meta]):
            dtype = stage_meta[bucket[0]][2]
            if stage == my_stage:
                tensors = gather_tp_params([local[i][1] for i in bucket])
                if pp == 1:
                    yield [(stage_meta[i][0], t) for i, t in zip(bucket, tensors, strict=True)]
                    continue
                flat = torch.cat([t.reshape(-1) for t in tensors])
            else:
                flat = torch.empty(sum(math.prod(stage_meta[i][1]) for i in bucket), dtype=dtype, device=device)
            dist.broadcast(flat, src=pp_ranks[stage], group=ps.get_pipeline_model_parallel_group())
            yield list(unflatten(flat, [stage_meta[i][:2] for i in bucket]))


def iter_hf_weight_buckets(
    chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig, bucket_bytes: int, convert: HFConverter | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """HF-named full tensors per bucket (default mapping: `convert.hf_mapping.megatron_to_hf`, which
    trims the vocabulary padding and maps a tied output layer to nothing). With tied embeddings
    `lm_head.weight` is emitted as the converted embedding, once."""
    if convert is None:
        from exgrpo_megatron.convert.hf_mapping import megatron_to_hf

        convert = megatron_to_hf
    tied = bool(unwrap_chunk(chunks[0]).share_embeddings_and_output_weights)
    for bucket in iter_full_param_buckets(chunks, bucket_bytes):
        hf: list[tuple[str, torch.Tensor]] = []
        for name, tensor in bucket:
            converted = convert(name, tensor, model_cfg)
            hf.extend(converted)
            if tied and name == EMBEDDING:
                hf.extend((HF_LM_HEAD_NAME, t) for _, t in converted)
        yield hf


def unflatten(flat: torch.Tensor, names_shapes: list[tuple[str, tuple[int, ...]]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view of `flat`) of consecutive tensors of the given shapes (a bucket's inverse of torch.cat)."""
    offset = 0
    for name, shape in names_shapes:
        n = math.prod(shape)
        yield name, flat[offset: offset + n].view(shape)
        offset += n
