"""What megatron-core 0.16 allocates on one rank for the trainable state, from the config alone: the model's
parameters, the DDP gradient buffers, the optimizer's fp32 master weights and Adam's two moments, each counted in
elements and split into dense and expert parts. The dry run's memory plan (planning/memory_plan.py) is these counts
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

With LoRA (`lora.rank` > 0, model/lora.py) every base tensor is frozen: it is a parameter (weights) but has no place
in a DDP buffer and no master or Adam state; only the adapters enter the buffers. Each adapted linear registers
`lora_a`, `lora_b` after its weight: a column-parallel one (QKV, fc1) A [r, in] whole and B [out / TP, r], a
row-parallel one (o_proj, fc2) A [r, in / TP] and B [out, r] whole; an expert's (`lora.experts`, ETP = 1) are in
the expert buffers as its weight is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from exgrpo_megatron.config.derived import head_dim, padded_vocab_size
from exgrpo_megatron.config.families import family_of
from exgrpo_megatron.config.schema import LoraConfig, ModelConfig, ParallelConfig

PARAM_ALIGN = 64  # the distributed optimizer starts each parameter at a multiple of 64 elements
BUCKET_ALIGN = 128  # ... and ends each bucket at a multiple of lcm(group size, 128)


@dataclass(frozen=True)
class ParamTensor:
    numel: int
    expert: bool = False  # in megatron's expert-parallel buffers (an expert's weight at EP > 1)
    shared_embedding: bool = False  # the tied embedding copy of the first or last stage at PP > 1: its own bucket
    trainable: bool = True  # False: a frozen base weight under LoRA (no buffer place, no optimizer state)


@dataclass(frozen=True)
class GroupState:
    """Elements of one gradient group (dense or expert) on one rank."""

    params: int = 0  # every parameter element, frozen ones included
    buffer: int = 0  # DDP buffer length with padding: the gradient buffer (and the parameter buffer with DistOpt)
    master: int = 0  # fp32 master elements (= exp_avg = exp_avg_sq elements)
    frozen: int = 0  # parameter elements that do not train (LoRA's base weights): outside the buffers

    @property
    def trainable(self) -> int:
        return self.params - self.frozen

    def __add__(self, other: GroupState) -> GroupState:
        return GroupState(self.params + other.params, self.buffer + other.buffer, self.master + other.master,
                          self.frozen + other.frozen)


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


def lora_on(lora: LoraConfig | None) -> bool:
    return lora is not None and lora.rank > 0


def _adapted(base: ParamTensor, name: str, a_shape: tuple[int, int], b_shape: tuple[int, int],
             lora: LoraConfig | None, of_expert: bool = False) -> list[ParamTensor]:
    """The linear's weight, then its adapters A, B if `lora` targets `name` (the weight frozen under LoRA);
    `of_expert`: an MoE expert's linear (adapted only with `lora.experts`)."""
    if not lora_on(lora):
        return [base]
    assert lora is not None
    weight = replace(base, trainable=False)
    if name not in lora.targets or (of_expert and not lora.experts):
        return [weight]
    return [weight, ParamTensor(math.prod(a_shape), base.expert), ParamTensor(math.prod(b_shape), base.expert)]


def layer_tensors(m: ModelConfig, p: ParallelConfig, lora: LoraConfig | None = None) -> list[ParamTensor]:
    """One decoder layer's parameters on one rank, in registration order: input norm, o_proj, QKV (+ bias),
    q/k norms, pre-MLP norm, then the router and every local expert's fc1, fc2, or the dense fc1, fc2; each
    adapted linear followed by its LoRA A and B."""
    family, tp, d, h = family_of(m.family), p.tensor_model_parallel_size, head_dim(m), m.hidden_size
    q_dim, qkv = m.num_attention_heads * d, (m.num_attention_heads + 2 * m.num_query_groups) * d // tp
    r, frozen = (lora.rank if lora is not None else 0), not lora_on(lora)
    base = [ParamTensor(h, trainable=frozen)]  # norms, biases, router: trainable only without LoRA
    out = [*base, *_adapted(ParamTensor(q_dim // tp * h), "linear_proj", (r, q_dim // tp), (h, r), lora)]
    out += _adapted(ParamTensor(qkv * h), "linear_qkv", (r, h), (qkv, r), lora)
    out += [ParamTensor(qkv, trainable=frozen)] if family.qkv_bias else []
    out += [ParamTensor(d, trainable=frozen), ParamTensor(d, trainable=frozen)] if family.qk_norm else []
    out.append(ParamTensor(h, trainable=frozen))
    if not m.num_experts:
        f = m.ffn_hidden_size // tp
        return [*out, *_adapted(ParamTensor(2 * f * h), "linear_fc1", (r, h), (2 * f, r), lora),
                *_adapted(ParamTensor(f * h), "linear_fc2", (r, f), (h, r), lora)]
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    fe, expert = (m.moe_ffn_hidden_size or m.ffn_hidden_size) // etp, ep > 1
    out.append(ParamTensor(m.num_experts * h, trainable=frozen))
    for _ in range(m.num_experts // ep):
        out += _adapted(ParamTensor(2 * fe * h, expert), "linear_fc1", (r, h), (2 * fe, r), lora, of_expert=True)
        out += _adapted(ParamTensor(fe * h, expert), "linear_fc2", (r, fe), (h, r), lora, of_expert=True)
    return out


def chunk_tensors(m: ModelConfig, p: ParallelConfig, pp_rank: int, chunk: int, lora: LoraConfig | None = None
                  ) -> list[ParamTensor]:
    """The parameters of model chunk `chunk` (0 without VPP) of pipeline stage `pp_rank`, in registration order."""
    pp, chunks = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    first, last = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == chunks - 1
    vocab_rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tensor_model_parallel_size)
    embedding = vocab_rows // p.tensor_model_parallel_size * m.hidden_size
    shared, trainable = m.tie_word_embeddings and pp > 1, not lora_on(lora)
    out = [ParamTensor(embedding, shared_embedding=shared, trainable=trainable)] if first else []
    out += layer_tensors(m, p, lora) * (m.num_layers // (pp * chunks))
    if last:
        out.append(ParamTensor(m.hidden_size, trainable=trainable))
        if not m.tie_word_embeddings or not first:
            out.append(ParamTensor(embedding, shared_embedding=shared, trainable=trainable))
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
    """One buffer's elements on the rank `group_rank` of the group the buffer is sharded over (the frozen tensors
    counted as parameters only)."""
    params = sum(t.numel for t in tensors)
    frozen = params - sum(t.numel for t in tensors if t.trainable)
    tensors = [t for t in tensors if t.trainable]
    if not tensors:
        return GroupState(params, frozen=frozen)
    buckets = bucket_layout(tensors, group_size, distributed)
    if not distributed:
        return GroupState(params, buckets[-1][1], params - frozen, frozen)
    master = 0
    for bucket_start, bucket_end, members in buckets:
        size = (bucket_end - bucket_start) // group_size
        lo = bucket_start + group_rank * size
        hi = min(lo + size, bucket_end)
        master += sum(max(0, min(e, hi) - max(s, lo)) for s, e in members)
    return GroupState(params, buckets[-1][1], master, frozen)


def rank_state(m: ModelConfig, p: ParallelConfig, world_size: int, rank: int, lora: LoraConfig | None = None
               ) -> RankState:
    """The trainable state megatron-core allocates on global rank `rank` of `world_size` (`lora`: the run's LoRA
    config; None or rank 0 = full fine-tuning)."""
    where = rank_coordinates(p, world_size, rank)
    dp, edp = dense_data_parallel_size(p, world_size), expert_data_parallel_size(p, world_size)
    dense, expert = GroupState(), GroupState()
    for chunk in range(p.virtual_pipeline_model_parallel_size or 1):
        tensors = chunk_tensors(m, p, where.pp_rank, chunk, lora)
        dense += group_state([t for t in tensors if not t.expert], dp, where.dp_rank, p.use_distributed_optimizer)
        expert += group_state([t for t in tensors if t.expert], edp, where.expert_dp_rank,
                              p.use_distributed_optimizer)
    return RankState(rank, where.pp_rank, dense, expert)


def every_rank_state(m: ModelConfig, p: ParallelConfig, world_size: int, lora: LoraConfig | None = None
                     ) -> list[RankState]:
    """rank_state of every rank (ranks with the same stage and shard coordinates computed once)."""
    seen: dict[RankCoordinates, RankState] = {}
    out = []
    for rank in range(world_size):
        where = rank_coordinates(p, world_size, rank)
        if where not in seen:
            seen[where] = rank_state(m, p, world_size, rank, lora)
        out.append(replace(seen[where], rank=rank))
    return out
