"""What megatron-core 0.16 allocates on one rank for the trainable state, from the config alone: the model's
parameters, the DDP gradient buffers, the optimizer's fp32 master weights and Adam's two moments, each counted in
elements and split into dense and expert parts. The dry run's memory plan (planning/dry_run.py) is these counts
times their bytes; tests/test_memory_plan.py checks them against what megatron allocates on gloo ranks.

How megatron shards them:

* parameters: the dense matrices over TP (QKV, o_proj, dense fc1/fc2, the vocab-parallel embedding and output layer),
  norms and the MoE router whole; each expert's fc1/fc2 over ETP and the experts over EP; the layers split evenly
  over the PP stages (x VPP chunks), the embedding on the first stage, the final norm and output layer on the last
  (a tied model keeps a copy of the embedding there when PP > 1, and a PP = 1 tied model has no output weight).
* DDP buffers (one per model chunk and gradient group, `DistributedDataParallel`): the dense parameters in one
  buffer sharded over the DP x CP group, the experts' (only at EP > 1: megatron marks an expert weight
  `allreduce=False` iff EP > 1) in another sharded over the expert-data-parallel group of
  world / (PP x EP x ETP) ranks (megatron's parallel_state). Parameters enter a buffer in reverse registration order;
  with the distributed optimizer each starts at a multiple of 64 elements, each bucket ends at a multiple of
  lcm(group size, 128), and a tied embedding shared between the first and last stage is a bucket of its own. The
  gradient buffer holds the whole padded buffer on every rank (fp32: `grad_reduce_in_fp32`, policy/policy.py);
  with the distributed optimizer a parameter buffer of the same length holds the weights.
* optimizer: with the distributed optimizer a rank owns the r-th of the group-size equal slices of each bucket and
  keeps an fp32 master copy (a view when the parameters are fp32) and exp_avg, exp_avg_sq of the parameter
  elements inside its slice; without it every parameter of the rank has them.

The tensor order is the local layer spec's (the CPU build); the Transformer Engine spec registers the same tensors
in another order, which moves only the 64-element alignment padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from exgrpo_megatron.config.derived import head_dim, padded_vocab_size
from exgrpo_megatron.config.families import family_of
from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig

PARAM_ALIGN = 64  # the distributed optimizer starts each parameter at a multiple of 64 elements
BUCKET_ALIGN = 128  # ... and ends each bucket at a multiple of lcm(group size, 128)


@dataclass(frozen=True)
class ParamTensor:
    numel: int
    expert: bool = False  # in megatron's expert-parallel buffers (an expert's weight at EP > 1)
    shared_embedding: bool = False  # the tied embedding copy of the first or last stage at PP > 1: its own bucket


@dataclass(frozen=True)
class GroupState:
    """Elements of one gradient group (dense or expert) on one rank."""

    params: int = 0
    buffer: int = 0  # DDP buffer length with padding: the gradient buffer (and the parameter buffer with DistOpt)
    master: int = 0  # fp32 master elements (= exp_avg = exp_avg_sq elements)

    def __add__(self, other: GroupState) -> GroupState:
        return GroupState(self.params + other.params, self.buffer + other.buffer, self.master + other.master)


@dataclass(frozen=True)
class RankState:
    """Elements megatron-core allocates for the trainable state on one rank (all its model chunks)."""

    rank: int
    pp_rank: int
    dense: GroupState
    expert: GroupState

    @property
    def total(self) -> GroupState:
        return self.dense + self.expert

    @property
    def adam(self) -> int:
        """exp_avg + exp_avg_sq elements."""
        return 2 * self.total.master


@dataclass(frozen=True)
class RankCoordinates:
    pp_rank: int
    dp_rank: int  # in the DP x CP group (the dense buffers)
    expert_dp_rank: int  # in the expert-data-parallel group (the expert buffers)


def expert_data_parallel_size(p: ParallelConfig, world_size: int) -> int:
    return world_size // (p.pipeline_model_parallel_size * p.expert_model_parallel_size * p.expert_tensor_parallel_size)


def dense_data_parallel_size(p: ParallelConfig, world_size: int) -> int:
    """The DP x CP group the dense buffers are sharded over."""
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def rank_coordinates(p: ParallelConfig, world_size: int, rank: int) -> RankCoordinates:
    """megatron's rank order tp-cp-ep-dp-pp: dense rank = tp + TP (cp + CP (dp + DP pp)), expert rank
    = etp + ETP (ep + EP (expert_dp + EDP pp))."""
    tp = p.tensor_model_parallel_size
    dp_cp = dense_data_parallel_size(p, world_size)
    ep_block = p.expert_tensor_parallel_size * p.expert_model_parallel_size
    return RankCoordinates(pp_rank=rank // (tp * dp_cp), dp_rank=rank // tp % dp_cp,
                           expert_dp_rank=rank // ep_block % expert_data_parallel_size(p, world_size))


def layer_tensors(m: ModelConfig, p: ParallelConfig) -> list[ParamTensor]:
    """One decoder layer's parameters on one rank, in registration order: input norm, o_proj, QKV (+ bias),
    q/k norms, pre-MLP norm, then the router and every local expert's fc1, fc2, or the dense fc1, fc2."""
    family, tp, d, h = family_of(m.family), p.tensor_model_parallel_size, head_dim(m), m.hidden_size
    q_dim, qkv = m.num_attention_heads * d, (m.num_attention_heads + 2 * m.num_query_groups) * d // tp
    out = [ParamTensor(h), ParamTensor(q_dim // tp * h), ParamTensor(qkv * h)]
    out += [ParamTensor(qkv)] if family.qkv_bias else []
    out += [ParamTensor(d), ParamTensor(d)] if family.qk_norm else []
    out.append(ParamTensor(h))
    if not m.num_experts:
        f = m.ffn_hidden_size // tp
        return [*out, ParamTensor(2 * f * h), ParamTensor(f * h)]
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    fe, expert = (m.moe_ffn_hidden_size or m.ffn_hidden_size) // etp, ep > 1
    out.append(ParamTensor(m.num_experts * h))
    for _ in range(m.num_experts // ep):
        out += [ParamTensor(2 * fe * h, expert), ParamTensor(fe * h, expert)]
    return out


def chunk_tensors(m: ModelConfig, p: ParallelConfig, pp_rank: int, chunk: int) -> list[ParamTensor]:
    """The parameters of model chunk `chunk` (0 without VPP) of pipeline stage `pp_rank`, in registration order."""
    pp, chunks = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    first, last = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == chunks - 1
    vocab_rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tensor_model_parallel_size)
    embedding = vocab_rows // p.tensor_model_parallel_size * m.hidden_size
    shared = m.tie_word_embeddings and pp > 1
    out = [ParamTensor(embedding, shared_embedding=shared)] if first else []
    out += layer_tensors(m, p) * (m.num_layers // (pp * chunks))
    if last:
        out.append(ParamTensor(m.hidden_size))
        if not m.tie_word_embeddings or not first:
            out.append(ParamTensor(embedding, shared_embedding=shared))
    return out


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def bucket_layout(tensors: list[ParamTensor], group_size: int, distributed: bool
                  ) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """megatron's `_ParamAndGradBuffer` layout (one bucket per buffer, overlap_grad_reduce off): the buckets as
    (start, end, [(param start, param end), ...]) in buffer elements."""
    buckets: list[tuple[int, int, list[tuple[int, int]]]] = []
    bucket_start, start, end = 0, 0, 0
    members: list[tuple[int, int]] = []

    def close(param_end: int) -> int:
        nonlocal bucket_start, members
        bucket_end = _ceil_to(param_end, math.lcm(group_size, BUCKET_ALIGN)) if distributed else param_end
        buckets.append((bucket_start, bucket_end, members))
        bucket_start, members = bucket_end, []
        return bucket_end

    for t in reversed(tensors):
        start = _ceil_to(start, PARAM_ALIGN) if distributed else start
        own_bucket = t.shared_embedding and distributed
        if own_bucket and members:
            start = close(start)
        end = start + t.numel
        members.append((start, end))
        start = close(end) if own_bucket else end
    if members:
        close(end)
    return buckets


def group_state(tensors: list[ParamTensor], group_size: int, group_rank: int, distributed: bool) -> GroupState:
    """One buffer's elements on the rank `group_rank` of the group the buffer is sharded over."""
    if not tensors:
        return GroupState()
    buckets = bucket_layout(tensors, group_size, distributed)
    params = sum(t.numel for t in tensors)
    if not distributed:
        return GroupState(params, buckets[-1][1], params)
    master = 0
    for bucket_start, bucket_end, members in buckets:
        size = (bucket_end - bucket_start) // group_size
        lo = bucket_start + group_rank * size
        hi = min(lo + size, bucket_end)
        master += sum(max(0, min(e, hi) - max(s, lo)) for s, e in members)
    return GroupState(params, buckets[-1][1], master)


def rank_state(m: ModelConfig, p: ParallelConfig, world_size: int, rank: int) -> RankState:
    """The trainable state megatron-core allocates on global rank `rank` of `world_size`."""
    where = rank_coordinates(p, world_size, rank)
    dp, edp = dense_data_parallel_size(p, world_size), expert_data_parallel_size(p, world_size)
    dense, expert = GroupState(), GroupState()
    for chunk in range(p.virtual_pipeline_model_parallel_size or 1):
        tensors = chunk_tensors(m, p, where.pp_rank, chunk)
        dense += group_state([t for t in tensors if not t.expert], dp, where.dp_rank, p.use_distributed_optimizer)
        expert += group_state([t for t in tensors if t.expert], edp, where.expert_dp_rank,
                              p.use_distributed_optimizer)
    return RankState(rank, where.pp_rank, dense, expert)


def every_rank_state(m: ModelConfig, p: ParallelConfig, world_size: int) -> list[RankState]:
    """rank_state of every rank (ranks with the same stage and shard coordinates computed once)."""
    seen: dict[RankCoordinates, RankState] = {}
    out = []
    for rank in range(world_size):
        where = rank_coordinates(p, world_size, rank)
        if where not in seen:
            seen[where] = rank_state(m, p, world_size, rank)
        out.append(replace(seen[where], rank=rank))
    return out
