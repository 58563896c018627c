"""The dry run: the plan of a run, from its validated config alone (no model, no process group).

    python -m exgrpo_megatron.train --config-name exgrpo_7b --dry-run --world-size 16

`dry_run_report(cfg, world_size, replays)` returns the parallel layout, the parameter count, per-GPU memory
estimates and the per-step work. The memory model (bytes per parameter follow Megatron-LM's
distributed-optimizer table, docs/source/api-guide/dist_optimizer.md; activations follow Korthikanti
et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", adapted to SwiGLU + GQA
with flash attention and no dropout):

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

When a phase's estimate exceeds the 80 GiB of an H100 80GB the report ends with a WARNING line naming the
estimate, its size and by how much it is over, with its parts; otherwise with "every estimate fits"; then the
fewest GPUs at the same TP/PP/CP/EP layout whose estimates fit (`fewest_gpus_that_fit`).

Generating ahead (planning/generation_split.py): with rollout.max_staleness > 0 `world_size` counts the training
ranks and the plan is for N = world_size + 1 GPUs (the generator's GPU added); otherwise one hint line for
N = world_size. Phase times from `--phase-times RUN_DIR`, else the documented default ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exgrpo_megatron.config.derived import head_dim, padded_vocab_size
from exgrpo_megatron.config.families import family_of
from exgrpo_megatron.config.schema import ModelConfig, RootConfig
from exgrpo_megatron.planning.generation_split import DEFAULT_PHASE_TIMES, PhaseTimes, split_lines
from exgrpo_megatron.planning.model_size import count_parameters, kv_bytes_per_token, param_bytes
from exgrpo_megatron.planning.sharding import (
    RankState,
    dense_data_parallel_size,
    every_rank_state,
    expert_data_parallel_size,
)

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


def estimate_memory(cfg: RootConfig, world_size: int) -> MemoryEstimate:
    m, p, r, d = cfg.model, cfg.parallel, cfg.rollout, cfg.data
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    counts = count_parameters(m, tp)
    state = most_loaded_rank(cfg, world_size)
    weights, grads, optimizer = state_bytes(cfg, state)
    with_rc, without_rc = activation_bytes(cfg, True), activation_bytes(cfg, False)
    seq_len = d.max_prompt_length + d.max_response_length
    if r.engine == "vllm":
        share = int(r.vllm.gpu_memory_utilization * GPU_MEMORY_GIB * GIB)
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


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:7.2f} GiB"


def _layout_lines(cfg: RootConfig, world_size: int) -> list[str]:
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = world_size // (tp * pp * cp)
    return [
        f"parallel layout (world size {world_size} = TP x PP x CP x DP):",
        f"  TP={tp}  PP={pp}  CP={cp}  DP={dp}  VPP={p.virtual_pipeline_model_parallel_size or '-'}  "
        f"sequence_parallel={p.sequence_parallel}  distributed_optimizer={p.use_distributed_optimizer}",
        f"  {dp} model replica(s) of {tp * pp * cp} GPU(s); each replica generates for its share of the prompts",
        *_expert_layout_lines(cfg, world_size),
    ]


def _expert_layout_lines(cfg: RootConfig, world_size: int) -> list[str]:
    m, p = cfg.model, cfg.parallel
    if not m.num_experts:
        return []
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    return [f"  experts: EP={ep}  ETP={etp}  expert-DP={expert_data_parallel_size(p, world_size)}: each GPU holds "
            f"{m.num_experts // ep} of the {m.num_experts} experts of each of its layers (1/{etp} of each), "
            f"{m.moe_router_topk} routed per token over the {m.moe_token_dispatcher} dispatcher; routing replay "
            + ("on: the updates route each token to the experts the rollout chose" if m.moe_routing_replay else
               "off (model.moe_routing_replay)")]


def _model_lines(cfg: RootConfig, state: RankState) -> list[str]:
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    counts = count_parameters(m, tp)
    experts = (f" and {m.num_experts} experts of {counts.per_layer_experts // m.num_experts:,} per layer"
               if m.num_experts else "")
    family = family_of(m.family)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    return [
        f"model {m.name} ({m.family}): {counts.total:,} parameters ({counts.total:.4g})",
        f"  {m.num_layers} layers x {counts.per_layer_sharded + counts.per_layer_replicated:,} "
        f"(QKV{'+bias' if family.qkv_bias else ''} with {m.num_query_groups} KV groups"
        f"{', QK-norm' if family.qk_norm else ''}, o_proj, {'router' if m.num_experts else 'SwiGLU fc1/fc2'}, 2 norms)"
        f"{experts}"
        f" + embedding {counts.embedding:,} (padded vocab {vocab:,})"
        f" + output {'tied' if m.tie_word_embeddings else f'{counts.output_layer:,}'} + final norm",
        f"  per GPU (most loaded rank {state.rank}, PP stage {state.pp_rank}): {state.total.params:,} parameters"
        + (f" ({state.dense.params:,} dense + {state.expert.params:,} expert-parallel)" if state.expert.params else ""),
    ]


def _memory_lines(cfg: RootConfig, world_size: int) -> tuple[list[str], list[str]]:
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    est = estimate_memory(cfg, world_size)
    dtype = "fp32" if param_bytes(m) == 4 else "bf16"
    rc = "full recompute" if m.recompute_activations else "no recompute"
    kv_per_token = kv_bytes_per_token(m, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    st, distributed = est.state, p.use_distributed_optimizer
    dense_shard = f"/ DP x CP = {dense_data_parallel_size(p, world_size)}" if distributed else "not sharded"
    expert_shard = (f" + expert {st.expert.master:,} ({'/ expert-DP = ' if distributed else 'not sharded'}"
                    f"{expert_data_parallel_size(p, world_size) if distributed else ''})") if st.expert.params else ""
    expert_buffer = f" + expert {st.expert.buffer:,}" if st.expert.params else ""
    lines = [
        f"per-GPU memory estimate (GPU target, {GPU_MEMORY_GIB:.0f} GiB; params_dtype={m.params_dtype} -> {dtype}; "
        f"most loaded rank {st.rank}, PP stage {st.pp_rank}; planning/sharding.py):",
        f"  weights          {_gib(est.weights)}   "
        f"{'parameter buffers' if distributed else 'parameters'}{' + the frozen base' if cfg.lora.rank > 0 else ''}"
        f" x {param_bytes(m)} B",
        f"  gradients        {_gib(est.grads)}   DDP buffers: dense {st.dense.buffer:,}{expert_buffer} elements x "
        f"{GRAD_BYTES} B (fp32 main grads)",
        f"  optimizer state  {_gib(est.optimizer)}   fp32 master + Adam m, v of dense {st.dense.master:,} "
        f"({dense_shard}){expert_shard} elements x {optimizer_bytes_per_element(m)} B",
        f"  activations      {_gib(est.activations)}   {rc}; micro-batch of {cfg.trainer.micro_batch_max_tokens} tokens"
        f" (without recompute {_gib(est.activations_no_recompute).strip()}, with full recompute "
        f"{_gib(est.activations_full_recompute).strip()}; includes logits + grad)",
    ]
    lines += _lora_lines(cfg, est)
    dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    if r.engine == "vllm":
        seqs = cfg.trainer.train_batch_size * r.n // dp
        demand = seqs * (cfg.data.max_prompt_length + cfg.data.max_response_length)
        lines.append(f"  vLLM share       {_gib(est.generation)}   rollout.vllm.gpu_memory_utilization "
                     f"{r.vllm.gpu_memory_utilization} x "
                     f"{GPU_MEMORY_GIB:.0f} GiB (its weight copy + KV cache)")
        lines.append(f"    KV-cache capacity ~{est.vllm_kv_tokens:,} tokens per engine "
                     f"({kv_bytes_per_token(m, p.tensor_model_parallel_size, 1):,} B/token/GPU); "
                     f"worst-case demand {demand:,} tokens ({seqs} sequences x full length; vLLM queues the rest)")
    else:
        seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
        lines.append(f"  KV cache         {_gib(est.generation)}   megatron engine: {r.max_batch_sequences} sequences"
                     f" x {seq_len} tokens x {kv_per_token:,} B/token")
    slack = f" + runtime slack {RUNTIME_SLACK_GIB:.0f} GiB (CUDA context, NCCL, allocator)"
    lines += [
        f"  training peak    {_gib(est.train_peak)}   weights + gradients + optimizer + activations{slack}",
        f"  generation peak  {_gib(est.generation_peak)}   weights + gradients + optimizer (resident) + "
        f"{'vLLM share' if r.engine == 'vllm' else 'KV cache'}{slack}",
    ]
    if r.engine == "vllm":
        over = " > " if est.train_peak_without_sleep > GPU_MEMORY_GIB * GIB else " <= "
        lines.append(f"  assumes vLLM sleeps while training (rollout.vllm.sleep_level={r.vllm.sleep_level} frees its "
                     f"share); without sleep the training peak is {est.train_peak_without_sleep / GIB:.1f} GiB"
                     f"{over}{GPU_MEMORY_GIB:.0f} GiB (training peak + vLLM share)")
    parts = {"training": [("weights", est.weights), ("gradients", est.grads), ("optimizer state", est.optimizer),
                          ("activations", est.activations), ("runtime slack", est.runtime_slack)],
             "generation": [("weights", est.weights), ("gradients", est.grads), ("optimizer state", est.optimizer),
                            ("vLLM share" if r.engine == "vllm" else "KV cache", est.generation),
                            ("runtime slack", est.runtime_slack)]}
    warnings = []
    for phase, value in (("training", est.train_peak), ("generation", est.generation_peak)):
        if value > GPU_MEMORY_GIB * GIB:
            listed = ", ".join(f"{name} {size / GIB:.1f}" for name, size in parts[phase])
            warnings.append(f"WARNING: does not fit: the {phase} estimate {value / GIB:.1f} GiB exceeds "
                            f"{GPU_MEMORY_GIB:.0f} GiB per GPU by {(value - GPU_MEMORY_GIB * GIB) / GIB:.1f} GiB "
                            f"({listed} GiB)")
    return lines, warnings


def _lora_lines(cfg: RootConfig, est: MemoryEstimate) -> list[str]:
    """LoRA: the frozen base (weights only) and the adapters (weights, gradients, optimizer state) apart."""
    lo, st, nbytes = cfg.lora, est.state.total, param_bytes(cfg.model)
    if lo.rank <= 0:
        return []
    base = st.frozen * nbytes
    adapters = est.train_state - base
    return [f"  LoRA rank {lo.rank} on {', '.join(lo.targets)}{' (experts too)' if lo.experts else ''}: "
            f"base {st.frozen:,} parameters frozen, {_gib(base).strip()} (weights only: no gradient, master or Adam)",
            f"    adapters {st.trainable:,} parameters trained, {_gib(adapters).strip()} "
            "(weights + gradients + optimizer state)"]


def fewest_gpus_that_fit(cfg: RootConfig, up_to: int = 256) -> int | None:
    """The smallest world size (a multiple of the layout's model-parallel and expert-parallel sizes, the batch
    divisible over its DP ranks) whose training and generation estimates fit one GPU; None up to `up_to`."""
    p = cfg.parallel
    dense, pp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size, \
        p.pipeline_model_parallel_size
    step = math.lcm(dense, pp * p.expert_model_parallel_size * p.expert_tensor_parallel_size)
    for world in range(step, up_to + 1, step):
        if cfg.trainer.ppo_mini_batch_size % (world // dense):
            continue
        est = estimate_memory(cfg, world)
        if max(est.train_peak, est.generation_peak) <= GPU_MEMORY_GIB * GIB:
            return world
    return None


def _step_lines(cfg: RootConfig, world_size: int, replays: bool) -> list[str]:
    t, r, d, p = cfg.trainer, cfg.rollout, cfg.data, cfg.parallel
    dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    seq_len = d.max_prompt_length + d.max_response_length
    sequences = t.train_batch_size * r.n
    updates = t.train_batch_size // t.ppo_mini_batch_size
    seqs_per_update_rank = t.ppo_mini_batch_size * r.n // dp
    seqs_per_micro = max(t.micro_batch_max_tokens // seq_len, 1)
    lines = [
        f"steps: {t.total_steps}; validation every {t.val_every}; checkpoint every {cfg.checkpoint.save_every}",
        f"per step: {t.train_batch_size} prompts x {r.n} rollouts = {sequences} sequences "
        f"({t.train_batch_size // dp} prompts / {sequences // dp} sequences per DP replica)",
        f"  tokens per step <= {sequences * seq_len:,} ({sequences} x (prompt {d.max_prompt_length} + "
        f"response {d.max_response_length}))",
        f"  optimizer updates per step: {updates * t.update_epochs} ({t.train_batch_size} / ppo_mini_batch_size "
        f"{t.ppo_mini_batch_size}" + (f", x {t.update_epochs} passes (trainer.update_epochs)" if t.update_epochs > 1
                                      else "") + ");"
        f" per update and DP rank {seqs_per_update_rank} sequences in >= "
        f"{math.ceil(seqs_per_update_rank / seqs_per_micro)} micro-batch(es) of <= {t.micro_batch_max_tokens} tokens",
    ]
    return [*lines, f"  {replay_line(cfg, replays)}"]


def replay_line(cfg: RootConfig, replays: bool) -> str:
    """What the algorithm replays (the dry run and the start-up block); `replays`: it has an experience pool."""
    t, x, k = cfg.trainer, cfg.experience, cfg.rollout.n
    if not replays:
        return f"experience replay: off (on-policy {cfg.algo.name})"
    n_exp = int(t.train_batch_size * x.ratio)
    start = (f"once batch pass rate > {x.delayed_start_pass_rate}" if x.delayed_start_pass_rate > 0
             else "from step 1 (delayed start disabled)")
    fresh = t.train_batch_size - n_exp if x.placement == "displace" else t.train_batch_size
    return (f"experience replay ({x.placement}): mixed phase {start}: up to {n_exp} replayed + {fresh} fresh prompts "
            f"(rho={x.ratio}; enter iff {x.admit_correct_above} < correct <= {x.admit_correct_at_most} of {k}, retire "
            f"above {x.retire_above(k)}" + (f", trajectories replayed up to {x.max_age_steps} steps old)"
                                            if x.max_age_steps else ")"))


def generation_line(cfg: RootConfig) -> str:
    """Where and when the rollouts are generated (the start-up block)."""
    r = cfg.rollout
    if r.max_staleness > 0:
        return (f"rollouts: {r.engine} engine in its own process, generating {r.max_staleness} step(s) ahead of "
                f"training (rollout.max_staleness={r.max_staleness}; fresh IS cap algo.fresh_is_cap="
                f"{cfg.algo.fresh_is_cap})")
    return f"rollouts: {r.engine} engine, generated within each step from the current weights"


def _generation_lines(cfg: RootConfig, world_size: int, times: PhaseTimes) -> list[str]:
    p, active = cfg.parallel, cfg.rollout.max_staleness > 0
    n_gpus = world_size + 1 if active else world_size
    if n_gpus < 2:
        return ["generation ahead: needs at least 2 GPUs (one generating, one training)"]
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    return split_lines(times, n_gpus, model_parallel, cfg.trainer.ppo_mini_batch_size, active)


def dry_run_report(cfg: RootConfig, world_size: int, replays: bool, phase_times: PhaseTimes | None = None) -> str:
    """The plan of a validated config at `world_size` GPUs (the caller has already run `validate`); `replays`:
    the algorithm has an experience pool (the caller builds the algorithm: config/ does not import algo/);
    `phase_times`: the colocated generate/train seconds for the generation-ahead plan (None: the default)."""
    memory, warnings = _memory_lines(cfg, world_size)
    sections = [
        [f"dry run: {cfg.model.name}, rollout engine {cfg.rollout.engine}, template {cfg.data.template}, "
         f"run_dir {cfg.logging.run_dir}"],
        _layout_lines(cfg, world_size),
        _model_lines(cfg, estimate_memory(cfg, world_size).state),
        memory,
        _step_lines(cfg, world_size, replays),
        _generation_lines(cfg, world_size, phase_times or DEFAULT_PHASE_TIMES),
        warnings or ["memory: every estimate fits in one GPU"],
        [f"memory: at this layout the estimates fit from {fewest} GPUs" if (fewest := fewest_gpus_that_fit(cfg))
         else "memory: at this layout no world size up to 256 GPUs fits"],
    ]
    return "\n".join(line for section in sections for line in section)
