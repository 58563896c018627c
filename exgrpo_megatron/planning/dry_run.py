"""The dry run: the plan of a run, from its validated config alone (no model, no process group).

    python -m exgrpo_megatron.train --config-name exgrpo_7b --dry-run --world-size 16 [--gpu-memory-gib 141]

`dry_run_report(cfg, world_size, replay)` returns the report's text -- the parallel layout, the parameter count, the
per-GPU memory plan (planning/memory_plan.py: its parts, the phases that do not fit one GPU as WARNING lines, the
fewest GPUs that fit at this layout) and the per-step work -- with those WARNING lines, from which the caller decides
the exit status.

Generating ahead (planning/generation_split.py): with rollout.max_staleness > 0 `world_size` counts the training
ranks and the plan is for N = world_size + 1 GPUs (the generator's GPU added); otherwise one hint line for
N = world_size. Phase times from `--phase-times RUN_DIR`, else the documented default ratio.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from exgrpo_megatron.config.derived import padded_vocab_size
from exgrpo_megatron.config.families import family_of
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.planning.generation_split import DEFAULT_PHASE_TIMES, PhaseTimes, split_lines
from exgrpo_megatron.planning.memory_plan import (
    GIB,
    GPU_MEMORY_GIB,
    GRAD_BYTES,
    RUNTIME_SLACK_GIB,
    MemoryEstimate,
    estimate_memory,
    fewest_gpus_that_fit,
    memory_overruns,
    optimizer_bytes_per_element,
)
from exgrpo_megatron.planning.model_size import count_parameters, kv_bytes_per_token, param_bytes
from exgrpo_megatron.planning.sharding import RankState, dense_data_parallel_size, expert_data_parallel_size


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


def _memory_lines(cfg: RootConfig, world_size: int, est: MemoryEstimate, gpu_memory_gib: float) -> list[str]:
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    dtype = "fp32" if param_bytes(m) == 4 else "bf16"
    rc = "full recompute" if m.recompute_activations else "no recompute"
    kv_per_token = kv_bytes_per_token(m, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    st, distributed = est.state, p.use_distributed_optimizer
    dense_shard = f"/ DP x CP = {dense_data_parallel_size(p, world_size)}" if distributed else "not sharded"
    expert_shard = (f" + expert {st.expert.master:,} ({'/ expert-DP = ' if distributed else 'not sharded'}"
                    f"{expert_data_parallel_size(p, world_size) if distributed else ''})") if st.expert.params else ""
    expert_buffer = f" + expert {st.expert.buffer:,}" if st.expert.params else ""
    lines = [
        f"per-GPU memory estimate (GPU target, {gpu_memory_gib:.0f} GiB; params_dtype={m.params_dtype} -> {dtype}; "
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
                     f"{gpu_memory_gib:.0f} GiB (its weight copy + KV cache)")
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
        over = " > " if est.train_peak_without_sleep > gpu_memory_gib * GIB else " <= "
        lines.append(f"  assumes vLLM sleeps while training (rollout.vllm.sleep_level={r.vllm.sleep_level} frees its "
                     f"share); without sleep the training peak is {est.train_peak_without_sleep / GIB:.1f} GiB"
                     f"{over}{gpu_memory_gib:.0f} GiB (training peak + vLLM share)")
    return lines


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


def _step_lines(cfg: RootConfig, world_size: int, replay: str) -> list[str]:
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
    return [*lines, f"  {replay}"]


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


class DryRunReport(NamedTuple):
    text: str
    overruns: list[str]  # the WARNING lines of memory_overruns: empty when every estimate fits one GPU


def dry_run_report(cfg: RootConfig, world_size: int, replay: str, phase_times: PhaseTimes | None = None,
                   gpu_memory_gib: float = GPU_MEMORY_GIB) -> DryRunReport:
    """The plan of a validated config at `world_size` GPUs of `gpu_memory_gib` each (the caller has already run
    `validate`); `replay`: what the algorithm replays, in one line (logging/startup.replay_summary: the caller builds
    the algorithm; planning/ does not import algo/); `phase_times`: the colocated generate/train seconds for the
    generation-ahead plan (None: the default)."""
    est, fewest = estimate_memory(cfg, world_size, gpu_memory_gib), fewest_gpus_that_fit(cfg, gpu_memory_gib)
    overruns = memory_overruns(cfg, est, gpu_memory_gib)
    sections = [
        [f"dry run: {cfg.model.name}, rollout engine {cfg.rollout.engine}, template {cfg.data.template}, "
         f"run_dir {cfg.logging.run_dir}"],
        _layout_lines(cfg, world_size),
        _model_lines(cfg, est.state),
        _memory_lines(cfg, world_size, est, gpu_memory_gib),
        _step_lines(cfg, world_size, replay),
        _generation_lines(cfg, world_size, phase_times or DEFAULT_PHASE_TIMES),
        overruns or ["memory: every estimate fits in one GPU"],
        [f"memory: at this layout the estimates fit from {fewest} GPUs" if fewest
         else "memory: at this layout no world size up to 256 GPUs fits"],
    ]
    return DryRunReport("\n".join(line for section in sections for line in section), overruns)
