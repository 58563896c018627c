"""Per-expert load of the MoE layers: how many of the tokens the training updates ran each expert received.

A forward hook on every megatron `TopKRouter` adds its routing map (tokens x experts, True where a token goes to an
expert) summed over tokens while `counting()` is on (the policy turns it on for the training updates' forwards,
not for forward-only passes or padding micro-batches). `take_metrics` sums the counts over the data-parallel group
(every DP rank routed its own tokens; TP ranks see the same tokens) and returns, per step:
  moe/expert_load/<e>   expert e's share of the routed token slots, averaged over this pipeline stage's layers
                        (uniform routing: 1 / num_experts each)
  moe/load_max_over_mean   max over (layer, expert) of the expert's count / the layer's mean count (1 = balanced)
With pipeline parallelism the metrics cover the stage of the rank that logs them (the first).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


class ExpertLoad:
    def __init__(self, modules: list[torch.nn.Module]):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for chunk in modules for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.counts: torch.Tensor | None = None  # [layers on this rank, experts], float64
        self.on = False
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, index: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if not self.on:
                return
            routing_map = output[1].detach()
            if self.counts is None:
                self.counts = torch.zeros(len(self.routers), routing_map.shape[-1], dtype=torch.float64)
            self.counts[index] += routing_map.sum(0).to(device="cpu", dtype=torch.float64)
        return hook

    @contextmanager
    def counting(self, on: bool = True) -> Iterator[None]:
        before, self.on = self.on, on and bool(self.routers)
        try:
            yield
        finally:
            self.on = before

    def take_metrics(self, dp_group: Any) -> dict[str, float]:
        """The step's load metrics (collective over `dp_group`); {} for a dense model."""
        if not self.routers:
            return {}
        counts = self.counts if self.counts is not None else torch.zeros(len(self.routers), 1, dtype=torch.float64)
        self.counts = None
        width = torch.tensor([counts.shape[1]])
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=dp_group)  # a rank that routed nothing has width 1
        full = torch.zeros(counts.shape[0], int(width), dtype=torch.float64)
        full[:, : counts.shape[1]] = counts
        dist.all_reduce(full, group=dp_group)
        per_layer = full.sum(1, keepdim=True).clamp_min(1.0)
        share = (full / per_layer).mean(0)
        out = {f"moe/expert_load/{e}": float(s) for e, s in enumerate(share)}
        out["moe/load_max_over_mean"] = float((full / (per_layer / full.shape[1])).max())
        return out
