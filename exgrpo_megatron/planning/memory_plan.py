"""The per-GPU memory plan of a run from its validated config alone: `estimate_memory(cfg, world_size,
gpu_memory_gib)` for the most loaded rank, `memory_overruns` (the phases that do not fit one GPU) and
`fewest_gpus_that_fit`. The dry run (planning/dry_run.py) prints it; a run on a GPU refuses to start when it does
not fit the card (planning/startup_checks.py). The model (bytes per parameter follow Megatron-LM's
distributed-optimizer table, docs/source/api-guide/dist_optimizer.md; activations follow Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", adapted to SwiGLU + GQA with flash attention and
no dropout):

* weights, gradients, optimizer state: what megatron-core allocates on each rank (planning/sharding.py: dense
  parameters over TP and the DP x CP ranks, experts over EP x ETP and the expert-data-parallel ranks, per PP stage);
  the most loaded rank is reported. Weights: parameter elements x bytes(params_dtype), `params_dtype=auto` counts
  as bf16 (the GPU target), the padded parameter buffer with the distributed optimizer; gradients: the DDP
  buffers x 4 B (fp32 main grads); optimizer: the rank's fp32 master elements x (4 B fp32 master copy, bf16 only,
  + 8 B Adam m, v);
* LoRA (`lora.rank` > 0): the frozen base is weights only; gradients and optimizer state are the adapters' (their
  buffers and shards, planning/sharding.py); the report shows base and adapters apart;
* activations of one micro-batch of `T = micro_batch_max_tokens / CP` tokens per rank, with `PP`
  micro-batches in flight on the first stage (1F1B): without recompute
  `T x L/PP x (4h/(TP if SP) + (2q + 2kv + 3f)/TP) x 2 B`, with QK-norm `(3q + 3kv + 3f)/TP` (the norms also
  keep their inputs); with full recompute only each layer's input
  `T x L/PP x h/(TP if SP) x 2 B` stays plus one layer recomputed; plus the vocab-parallel logits
  and their gradient, `2 x T x V/TP x 2 B` (the log-prob kernel chunks its fp32 buffers);
* KV cache: megatron engine `max_batch_sequences x (prompt + response) x 2 x L/PP x G/TP x d x 2 B`;
  vLLM takes `rollout.vllm.gpu_memory_utilization x GPU memory` for its own weight copy plus KV cache;
* runtime slack per rank: CUDA context, NCCL communicator buffers and caching-allocator fragmentation
  (RUNTIME_SLACK_GIB), added to both peaks.

With vLLM the plan assumes its sleep mode frees the share while the policy trains (`rollout.vllm.sleep_level`);
the report also shows the training peak without sleep (training peak + the share), which is what a
platform without sleep mode needs.

The target GPU's memory is `gpu_memory_gib` (the command line's `--gpu-memory-gib`; GPU_MEMORY_GIB, the paper's
H100 80GB, by default; a run on a GPU uses the card's own). A phase whose estimate exceeds it is an overrun: the
dry run prints it as a WARNING line naming the estimate, its size, by how much it is over and its parts, and exits
3; otherwise it prints "every estimate fits"; then the fewest GPUs at the same TP/PP/CP/EP layout whose estimates
fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exgrpo_megatron.config.derived import head_dim, padded_vocab_size
from exgrpo_megatron.config.families import family_of
from exgrpo_megatron.config.schema import ModelConfig, RootConfig
from exgrpo_megatron.planning.model_size import count_parameters, kv_bytes_per_token, param_bytes
from exgrpo_megatron.planning.sharding import RankState, every_rank_state

GIB = 1024**3
GPU_MEMORY_GIB = 80.0  # one H100 80GB (the paper's hardware)
GRAD_BYTES = 4  # fp32 main-grad buffer
ADAM_STATE_BYTES = 8  # fp32 exp_avg + exp_avg_sq
# Per rank, outside the estimates above: CUDA context ~0.5-1 GiB, NCCL buffers ~1 GiB, allocator fragmentation.
RUNTIME_SLACK_GIB = 3.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of the most loaded rank."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    activations_no_recompute: int
    activations_full_recompute: int
    generation: int  # KV cache (megatron engine) or the vLLM share (weights + KV)
    vllm_kv_tokens: int  # vLLM: KV-cache capacity in tokens per rank (0 for the megatron engine)
    state: RankState  # the most loaded rank's elements (dense and expert)
    runtime_slack: int = int(RUNTIME_SLACK_GIB * GIB)  # CUDA context + NCCL + allocator, per rank
    vllm_share: int = 0  # the vLLM share (0 for the megatron engine)

    @property
    def train_state(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def train_peak(self) -> int:
        """Training with vLLM asleep (its share freed)."""
        return self.train_state + self.activations + self.runtime_slack

    @property
    def generation_peak(self) -> int:
        return self.train_state + self.generation + self.runtime_slack

    @property
    def train_peak_without_sleep(self) -> int:
        """Training while vLLM keeps its share (no sleep mode)."""
        return self.train_peak + self.vllm_share


def activation_bytes(cfg: RootConfig, recompute: bool) -> int:
    """Activation memory of the first/last stage for one micro-batch budget (see module docstring)."""
    m, p = cfg.model, cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    sp_div = tp if p.sequence_parallel else 1
    d = head_dim(m)
    h = m.hidden_size
    f = m.moe_router_topk * (m.moe_ffn_hidden_size or m.ffn_hidden_size) if m.num_experts else m.ffn_hidden_size
    q_dim, kv_dim = m.num_attention_heads * d, m.num_query_groups * d
    tokens = cfg.trainer.micro_batch_max_tokens // cp
    nbytes = param_bytes(m)
    qk = 3 if family_of(m.family).qk_norm else 2
    layer_elems = 4 * h / sp_div + (qk * q_dim + qk * kv_dim + 3 * f) / tp
    layers_in_flight = (m.num_layers // pp) * pp
    if recompute:
        stored = tokens * layers_in_flight * h / sp_div * nbytes + tokens * layer_elems * nbytes
    else:
        stored = tokens * layers_in_flight * layer_elems * nbytes
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    logits = 2 * tokens * vocab / tp * nbytes
    return int(stored + logits)


def optimizer_bytes_per_element(m: ModelConfig) -> int:
    """fp32 master copy (bf16 parameters only; fp32 parameters are their own master) + Adam m, v."""
    return (4 if param_bytes(m) == 2 else 0) + ADAM_STATE_BYTES


def state_bytes(cfg: RootConfig, state: RankState) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes of one rank's elements (LoRA's frozen base: weights only)."""
    total = state.total
    distributed = cfg.parallel.use_distributed_optimizer
    weights = (total.buffer + total.frozen if distributed else total.params) * param_bytes(cfg.model)
    return weights, total.buffer * GRAD_BYTES, total.master * optimizer_bytes_per_element(cfg.model)


def most_loaded_rank(cfg: RootConfig, world_size: int) -> RankState:
    """The rank whose weights + gradients + optimizer state are largest (the first of equals)."""
    return max(every_rank_state(cfg.model, cfg.parallel, world_size, cfg.lora),
               key=lambda st: sum(state_bytes(cfg, st)))


def estimate_memory(cfg: RootConfig, world_size: int, gpu_memory_gib: float = GPU_MEMORY_GIB) -> MemoryEstimate:
    m, p, r, d = cfg.model, cfg.parallel, cfg.rollout, cfg.data
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    counts = count_parameters(m, tp)
    state = most_loaded_rank(cfg, world_size)
    weights, grads, optimizer = state_bytes(cfg, state)
    with_rc, without_rc = activation_bytes(cfg, True), activation_bytes(cfg, False)
    seq_len = d.max_prompt_length + d.max_response_length
    if r.engine == "vllm":
        share = int(r.vllm.gpu_memory_utilization * gpu_memory_gib * GIB)
        vllm_weights = counts.total // tp * 2
        kv_tokens = max(share - vllm_weights, 0) // kv_bytes_per_token(m, tp, 1)
        generation = share
    else:
        kv_tokens = 0
        generation = r.max_batch_sequences * seq_len * kv_bytes_per_token(m, tp, pp)
    return MemoryEstimate(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=with_rc if m.recompute_activations else without_rc,
        activations_no_recompute=without_rc,
        activations_full_recompute=with_rc,
        generation=generation,
        vllm_kv_tokens=kv_tokens,
        state=state,
        vllm_share=generation if r.engine == "vllm" else 0,
    )


def memory_overruns(cfg: RootConfig, est: MemoryEstimate, gpu_memory_gib: float) -> list[str]:
    """One line per phase (training, generation) whose estimate `est` (`estimate_memory` at `gpu_memory_gib`) exceeds
    `gpu_memory_gib`, with its parts; [] when both fit. The dry run exits 3 on any, a run on a GPU refuses to start
    (planning/startup_checks.py)."""
    r, limit = cfg.rollout, gpu_memory_gib * GIB
    parts = {"training": [("weights", est.weights), ("gradients", est.grads), ("optimizer state", est.optimizer),
                          ("activations", est.activations), ("runtime slack", est.runtime_slack)],
             "generation": [("weights", est.weights), ("gradients", est.grads), ("optimizer state", est.optimizer),
                            ("vLLM share" if r.engine == "vllm" else "KV cache", est.generation),
                            ("runtime slack", est.runtime_slack)]}
    overruns = []
    for phase, value in (("training", est.train_peak), ("generation", est.generation_peak)):
        if value > limit:
            listed = ", ".join(f"{name} {size / GIB:.1f}" for name, size in parts[phase])
            overruns.append(f"WARNING: does not fit: the {phase} estimate {value / GIB:.1f} GiB exceeds "
                            f"{gpu_memory_gib:.0f} GiB per GPU by {(value - limit) / GIB:.1f} GiB "
                            f"({listed} GiB)")
    return overruns


def fewest_gpus_that_fit(cfg: RootConfig, gpu_memory_gib: float = GPU_MEMORY_GIB, up_to: int = 256) -> int | None:
    """The smallest world size (a multiple of the layout's model-parallel and expert-parallel sizes, the batch
    divisible over its DP ranks) whose training and generation estimates fit one GPU; None up to `up_to`."""
    p = cfg.parallel
    dense, pp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size, \
        p.pipeline_model_parallel_size
    step = math.lcm(dense, pp * p.expert_model_parallel_size * p.expert_tensor_parallel_size)
    for world in range(step, up_to + 1, step):
        if cfg.trainer.ppo_mini_batch_size % (world // dense):
            continue
        if not memory_overruns(cfg, estimate_memory(cfg, world, gpu_memory_gib), gpu_memory_gib):
            return world
    return None
