"""Gather a rank's megatron parameters (or their grads) into full, layout-independent tensors
named as in a TP=1/PP=1 model, so tests can compare layouts. Collective over TP and PP groups.
Names and TP splits are model/param_layout.py's (global layer indices under PP and VPP)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from exgrpo_megatron.model.param_layout import (
    is_expert_param,
    named_global_params,
    tp_coords,
    tp_shard,
    tp_split_of_param,
    tp_unshard,
)


def _gather_tp(t: torch.Tensor, param: torch.nn.Parameter, name: str) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp, split = tp_coords(name)[0], tp_split_of_param(param)
    if tp == 1 or split is None:
        return t
    group = ps.get_expert_tensor_parallel_group() if is_expert_param(name) else ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return tp_unshard(parts, split)


def full_tensors(modules: list[torch.nn.Module], what: str = "data", trainable_only: bool = False) -> dict:
    """`what` = "data" (weights) or "grad" (DDP main_grad). Returns {tp1_name: tensor} on every rank;
    a tied output layer's copy of the embedding is left out. `trainable_only`: the parameters that require a
    gradient (a LoRA model's adapters: frozen weights have no main_grad)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    local: dict[str, torch.Tensor] = {}
    for name, p in named_global_params(modules, tied_copy=False):
        if trainable_only and not p.requires_grad:
            continue
        t = p.main_grad if what == "grad" else p.data  # type: ignore[attr-defined]  # DDP sets main_grad
        local[name] = _gather_tp(t.detach().float(), p, name).clone()
    if ps.get_expert_model_parallel_world_size() > 1:  # each EP rank holds other experts
        experts: list = [None] * ps.get_expert_model_parallel_world_size()
        dist.all_gather_object(experts, {k: v for k, v in local.items() if is_expert_param(k)},
                               group=ps.get_expert_model_parallel_group())
        local.update({k: v for d in experts for k, v in d.items()})
    if pp == 1:
        return local
    gathered: list = [None] * pp
    dist.all_gather_object(gathered, local, group=ps.get_pipeline_model_parallel_group())
    return {k: v for d in gathered for k, v in d.items()}


def load_full_tensors(modules: list[torch.nn.Module], full: dict) -> None:
    """Set every local parameter from TP=1/PP=1-named full tensors (slicing this rank's TP part).
    A tied output layer on the last pipeline stage takes the word embedding."""

    for name, p in named_global_params(modules, tied_copy=True):
        tp, rank = tp_coords(name)
        with torch.no_grad():
            p.data.copy_(tp_shard(full[name], tp_split_of_param(p), tp, rank).to(p.dtype))


def with_random_lora_b(full: dict, seed: int, scale: float = 0.05) -> dict:
    """`full` with every adapter's B drawn from N(0, scale^2), in name order from a generator seeded by `seed`: adapters
    that change the function (B starts at 0), the same at every layout."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=g) * scale if name.endswith("lora_b") else t
            for name, t in sorted(full.items())}
