"""Full (un-sharded) policy weights for an inference engine that holds its own copy (vLLM refit).

Every rank of a model replica (TP, PP and EP ranks) calls `iter_full_param_buckets(chunks, bucket_bytes)`
with its model chunks (one per virtual pipeline stage) and receives the same sequence of buckets of (global
megatron name, full TP=1-layout tensor). Names and sharding come from model/param_layout.py:

- TP: one all-gather per bucket of the flattened local shards over the TP group; each sharded
  parameter is reassembled from the split megatron recorded on it (`tp_split_of_param`; stride 2 is
  SwiGLU's fc1, whose shards are [gate_r; up_r]).
- EP: each expert parameter of a bucket is all-gathered over the EP group (one all-gather per bucket) and
  emitted once per EP rank under that rank's global expert names, so every rank ends with every expert
  (vLLM holds them all; the bucket's size counts every EP rank's copy).
- PP: each stage's buckets (all its VPP chunks, chunk by chunk) are broadcast, flattened, from that
  stage over the PP group, so every stage ends with every weight (vLLM's loaders shard them again
  for their own TP rank).
- Names: the TP=1/PP=1 model's names (`named_global_params`, global layer indices under PP and
  VPP). With tied embeddings the last stage's copy of the embedding (`output_layer.weight`, PP > 1
  only) is skipped; `iter_hf_weight_buckets` emits `lm_head.weight` from the embedding instead
  (vLLM needs it explicitly).
- LoRA (model/lora.py): `iter_merged_param_buckets` (vLLM's refit through `iter_hf_weight_buckets`, and the
  generator process's weights, training/async_generation/) sends an adapted linear's merged weight W + (B A) alpha/r in
  place of W, lora_a and lora_b (`merge_adapters_in_stream`): each weight is held only until its two adapters
  (the next parameters of the same linear) have streamed, so at most one linear's full tensors are held beyond a
  bucket (no second copy of the model).

Buckets are consecutive runs of one stage's parameters in `named_parameters()` order, closed as
soon as they reach `bucket_bytes` (or when the dtype changes), so every tensor appears exactly once,
the order is stable, and every bucket but a stage's last is >= the threshold (slime-style flattened
buckets).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.model.param_layout import (
    ADAPTER_SUFFIXES,
    EMBEDDING,
    is_expert_param,
    named_global_params,
    split_expert_name,
    split_layer_name,
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


def expert_names_by_ep_rank(local: Sequence[tuple[str, torch.Tensor]]) -> list[list[str]] | None:
    """Every EP rank's global names of its parameters (index = EP rank; an EP rank's list has the same length and
    shapes as this rank's, its experts being other global experts), None at EP = 1."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return None
    names: list = [None] * ep
    dist.all_gather_object(names, [name for name, _ in local], group=ps.get_expert_model_parallel_group())
    return names


def gather_ep_params(names: list[str], tensors: list[torch.Tensor], ep_names: list[list[str]] | None,
                     indices: list[int]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of a bucket with every expert parameter replaced by each EP rank's copy (its experts, in EP
    rank order) by ONE all-gather over the EP group; `indices`: the bucket's positions in this rank's list."""
    from megatron.core import parallel_state as ps

    experts = [k for k, name in enumerate(names) if ep_names is not None and is_expert_param(name)]
    if ep_names is None or not experts:
        return list(zip(names, tensors, strict=True))
    flat = torch.cat([tensors[k].reshape(-1) for k in experts])
    gathered = [torch.empty_like(flat) for _ in ep_names]
    dist.all_gather(gathered, flat, group=ps.get_expert_model_parallel_group())
    offsets = dict(zip(experts, itertools.accumulate([0] + [tensors[k].numel() for k in experts]), strict=False))
    out: list[tuple[str, torch.Tensor]] = []
    for k, (name, t) in enumerate(zip(names, tensors, strict=True)):
        if k not in offsets:
            out.append((name, t))
            continue
        piece = slice(offsets[k], offsets[k] + t.numel())
        out.extend((rank_names[indices[k]], g[piece].view(t.shape)) for rank_names, g in zip(ep_names, gathered,
                                                                                            strict=True))
    return out


def iter_full_param_buckets(chunks: Sequence[torch.nn.Module], bucket_bytes: int
                            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the replica's full weights bucket by bucket, identically on all its TP, PP and EP ranks.
    `chunks`: this rank's model chunks (DDP/Float16Module-wrapped or bare), in virtual stage order."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    local = named_global_params(chunks, tied_copy=False)
    ep_names = expert_names_by_ep_rank(local)
    copies = [len(ep_names) if ep_names is not None and is_expert_param(name) else 1 for name, _ in local]
    shapes = [tp_full_shape(p.shape, tp_split_of_param(p), tp) for _, p in local]
    sizes = [math.prod(shape) * p.dtype.itemsize * n for shape, (_, p), n in zip(shapes, local, copies, strict=True)]
    buckets = plan_buckets(sizes, bucket_bytes, keys=[p.dtype for _, p in local])
    # what each bucket emits: (name, full shape, dtype), an expert parameter once per EP rank
    every_name = [[r[i] for r in ep_names] if ep_names is not None and copies[i] > 1 else [name]
                  for i, (name, _) in enumerate(local)]
    meta = [[(name, shapes[i], local[i][1].dtype) for i in b for name in every_name[i]] for b in buckets]
    if pp > 1:
        every_stage: list = [None] * pp
        dist.all_gather_object(every_stage, meta, group=ps.get_pipeline_model_parallel_group())
        pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    else:
        every_stage, pp_ranks = [meta], [dist.get_rank() if dist.is_initialized() else 0]
    my_stage = ps.get_pipeline_model_parallel_rank()
    device = local[0][1].device
    for stage, stage_meta in enumerate(every_stage):
        for k, bucket_meta in enumerate(stage_meta):
            if stage == my_stage:
                bucket = buckets[k]
                tensors = gather_tp_params([local[i][1] for i in bucket])
                named = gather_ep_params([local[i][0] for i in bucket], tensors, ep_names, bucket)
                if pp == 1:
                    yield named
                    continue
                flat = torch.cat([t.reshape(-1) for _, t in named])
            else:
                flat = torch.empty(sum(math.prod(shape) for _, shape, _ in bucket_meta), dtype=bucket_meta[0][2],
                                   device=device)
            dist.broadcast(flat, src=pp_ranks[stage], group=ps.get_pipeline_model_parallel_group())
            yield list(unflatten(flat, [(name, shape) for name, shape, _ in bucket_meta]))


def iter_merged_param_buckets(chunks: Sequence[torch.nn.Module], bucket_bytes: int
                              ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`iter_full_param_buckets` with LoRA's adapters merged into their weights (`merge_adapters_in_stream`): the
    weights of a model without adapters that computes the adapted policy (a bucket may come out empty)."""
    buckets = iter_full_param_buckets(chunks, bucket_bytes)
    lora = adapted_linears(chunks)
    return buckets if lora is None else merge_adapters_in_stream(buckets, *lora)


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
    for bucket in iter_merged_param_buckets(chunks, bucket_bytes):
        hf: list[tuple[str, torch.Tensor]] = []
        for name, tensor in bucket:
            converted = convert(name, tensor, model_cfg)
            hf.extend(converted)
            if tied and name == EMBEDDING:
                hf.extend((HF_LM_HEAD_NAME, t) for _, t in converted)
        yield hf


def adapted_linears(chunks: Sequence[torch.nn.Module]) -> tuple[float, set[str]] | None:
    """LoRA's alpha / rank and the adapted linears' layer-generic names ("self_attention.linear_qkv",
    "mlp.experts.local_experts.*.linear_fc1", ...) of the policy (model/lora.py); None without adapters. Every
    pipeline stage is built from the same layer spec, so this stage's linears say it for all."""
    scale, generic = None, set[str]()
    for name, module in unwrap_chunk(chunks[0]).named_modules():
        if hasattr(module, "lora_scale"):
            scale = float(module.lora_scale)
            generic.add(_generic_linear(name))
    return None if scale is None else (scale, generic)


def _generic_linear(name: str) -> str:
    """A linear's name without its layer and expert index: "decoder.layers.3.mlp.experts.local_experts.1.linear_fc1"
    -> "mlp.experts.local_experts.*.linear_fc1"."""
    suffix = split_layer_name(name)[1]
    return split_expert_name(suffix + ".weight")[1].removesuffix(".weight")


def merge_adapters_in_stream(buckets: Iterable[list[tuple[str, torch.Tensor]]], scale: float, adapted: set[str]
                             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream with every adapted linear's `weight`, `lora_a` and `lora_b` (`adapted`: the linears'
    layer-generic names) replaced by one merged `weight` = W + (B A) * scale, computed in fp32 and cast to W's
    dtype, emitted in the bucket where the last of the three arrives; every other tensor passes through.
    Megatron registers a linear's adapters right after its weight (and bias), so a weight waits only for the next
    parameters of its own linear."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for bucket in buckets:
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in bucket:
            stem, _, leaf = name.rpartition(".")
            if leaf not in ("weight", *ADAPTER_SUFFIXES) or _generic_linear(stem) not in adapted:
                out.append((name, tensor))
                continue
            parts = pending.setdefault(stem, {})
            parts[leaf] = tensor
            if len(parts) == 3:
                del pending[stem]
                w, a, b = parts["weight"], parts["lora_a"], parts["lora_b"]
                merged = w.float() + (b.float() @ a.float()) * scale
                out.append((f"{stem}.weight", merged.to(w.dtype)))
        yield out
    if pending:
        raise RuntimeError(f"LoRA refit: the weight or adapters of {sorted(pending)} never streamed")


def unflatten(flat: torch.Tensor, names_shapes: list[tuple[str, tuple[int, ...]]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view of `flat`) of consecutive tensors of the given shapes (a bucket's inverse of torch.cat)."""
    offset = 0
    for name, shape in names_shapes:
        n = math.prod(shape)
        yield name, flat[offset: offset + n].view(shape)
        offset += n
