"""Start-up checks of a mixture-of-experts configuration (model/moe.py): the expert layout megatron-core can build
from the world size, and the MoE keys' relations to the rest of the config. Each error names its key."""

from __future__ import annotations

from exgrpo_megatron.config.families import FAMILIES
from exgrpo_megatron.config.schema import RootConfig


def moe_config_errors(cfg: RootConfig, world_size: int) -> list[str]:
    m, p = cfg.model, cfg.parallel
    ep, etp, tp, pp = (p.expert_model_parallel_size, p.expert_tensor_parallel_size, p.tensor_model_parallel_size,
                       p.pipeline_model_parallel_size)
    e: list[str] = []
    if m.num_experts <= 0:
        if ep > 1 or etp > 1:
            e.append(f"parallel.expert_model_parallel_size: EP={ep}, ETP={etp} needs a mixture-of-experts model "
                     "(model.num_experts > 0)")
        if m.family in FAMILIES and FAMILIES[m.family].moe is not None:
            e.append(f"model.num_experts: model.family={m.family} is a mixture-of-experts family (needs > 0)")
        return e
    if m.moe_router_topk > m.num_experts:
        e.append(f"model.moe_router_topk: {m.moe_router_topk} experts per token but model.num_experts={m.num_experts}")
    if ep > 0 and m.num_experts % ep:
        e.append(f"parallel.expert_model_parallel_size: EP={ep} does not divide model.num_experts={m.num_experts} "
                 "(each EP rank holds num_experts / EP whole experts)")
    ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if etp > 0 and ffn % etp:
        e.append(f"parallel.expert_tensor_parallel_size: ETP={etp} does not divide the expert width {ffn} "
                 "(model.moe_ffn_hidden_size)")
    experts_grid = ep * etp * pp
    if experts_grid > 0 and world_size % experts_grid:
        e.append(f"parallel.expert_model_parallel_size: world size {world_size} is not divisible by "
                 f"EP x ETP x PP = {ep} x {etp} x {pp} (megatron-core's expert grid)")
    if ep > 1 and tp > 1 and not p.sequence_parallel:
        e.append("parallel.sequence_parallel: megatron-core needs sequence parallelism with expert and tensor "
                 "parallelism together (EP > 1 and TP > 1)")
    if ep > 1 and m.moe_token_dispatcher == "allgather":
        e.append("model.moe_token_dispatcher: allgather needs the same token count on every EP rank; with EP > 1 "
                 "our micro-batches differ in length between ranks: use alltoall (or flex on GPU)")
    if m.moe_grouped_gemm and m.layer_spec == "local":
        e.append("model.moe_grouped_gemm: grouped GEMM experts need the Transformer Engine spec (model.layer_spec "
                 "te or auto on GPU); the local spec runs the experts one by one")
    if m.moe_token_dispatcher == "flex" and m.layer_spec == "local":
        e.append("model.moe_token_dispatcher: flex (DeepEP) runs on GPU with the Transformer Engine spec")
    e += routing_replay_errors(cfg)
    if m.family in FAMILIES and FAMILIES[m.family].moe is None:
        e.append(f"model.num_experts: model.family={m.family} is a dense family (config/families.py); "
                 f"mixture-of-experts families: {sorted(n for n, f in FAMILIES.items() if f.moe is not None)}")
    return e


def routing_replay_errors(cfg: RootConfig) -> list[str]:
    """What `model.moe_routing_replay` (model/routing_replay.py) cannot honour: the choices are recorded by the
    megatron engine in the trainer's process, and imposed token by token on an unsplit sequence."""
    m, p = cfg.model, cfg.parallel
    if not m.moe_routing_replay:
        return []
    key, e = "model.moe_routing_replay", []
    import torch

    if cfg.rollout.engine == "vllm" and not torch.cuda.is_available():
        e.append(f"{key}: with rollout.engine=vllm the experts come from vLLM's enable_return_routed_experts, "
                 "which needs its model runner V2 and Triton: GPU only (on CPU use rollout.engine=megatron)")
    if cfg.rollout.max_staleness > 0:
        e.append(f"{key}: the generator process generating ahead (rollout.max_staleness > 0) does not record the "
                 "experts yet")
    split = {"parallel.tensor_model_parallel_size": p.tensor_model_parallel_size,
             "parallel.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
             "parallel.context_parallel_size": p.context_parallel_size}
    e += [f"{k}: {v} with {key} is not supported yet (tested: the whole sequence and every layer on one rank; "
          "expert parallelism is)" for k, v in split.items() if v > 1]
    return e

