"""Lockstep under expert parallelism: the one gate every model forward of an expert-parallel run passes through.

With EP > 1 every MoE layer of every forward exchanges tokens between the ranks of an EP group (the token
dispatcher's all-to-all), and a training pass ends in the gradient sync over the data-parallel ranks. The ranks hold
different data (their own questions, candidates, rows and response lengths), so any branch on this rank's own work
-- "no replay candidates here", "no rows need pi_old here", "no groups left after the filter", "this rank finished
generating" -- would make one rank skip, or add, a collective the others wait in: a hang.

So no caller branches on local emptiness. Every pass site calls `Lockstep.agree(site, count)` on every rank, in the
same order, with this rank's count of work (micro-batches of a policy pass; 1 or 0 for one forward round of
generation), and gets the largest count over the run's ranks. The policy's pass (`Policy.forward_backward`) then
runs that many micro-batches, padding with empty ones (policy/expert_sync.py), and returns [] on every rank when
the agreed count is 0; the rollout engine runs a forward round while the agreed flag is 1, a rank that has finished
joining with a one-token forward (rollout/megatron_engine.py). The agreement is one small all-reduce over the world
group: it covers every EP group and the data-parallel gradient sync (a pass that is empty on a whole EP group but
not elsewhere still joins it), at the price of padding an EP group to the busiest group's count.

At EP = 1 a forward has no collective across data-parallel ranks, so a forward-only pass exchanges nothing: `agree`
returns the local count and the pass runs exactly as before. A training pass still ends in the data-parallel
gradient sync, so with more than one rank its count is agreed too (`gradient_sync=True`), and a rank without
micro-batches joins the others' pass with one padding micro-batch instead of skipping the sync they wait in.

Sites are named ("replay_scores", "old_logprobs", "update", "warm_start", "generate", ...): `site` holds the one
running now (or last), and every observer is told (site, local count, agreed count) at each agreement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from exgrpo_megatron.distributed.collective_ledger import agreement_for

# (site, this rank's count, the agreed count), at every agreement, before the pass runs
SiteObserver = Callable[[str, int, int], None]


class Lockstep:
    """The agreement of a run's ranks on the number of forwards of each pass (module docstring).
    `ep_group`: the expert-parallel process group, None when EP = 1 (then nothing is exchanged)."""

    def __init__(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.site = ""  # the pass site agreed on last (the one running now)
        self.observers: list[SiteObserver] = []

    @property
    def expert_parallel(self) -> bool:
        return self.ep_group is not None

    def agree(self, site: str, count: int, gradient_sync: bool = False) -> int:
        """Collective over the run's ranks at EP > 1, and for a pass ending in a `gradient_sync` whenever there is
        more than one rank (every rank calls it, whatever its own `count`): the largest `count` of any rank.
        Otherwise `count` itself, no exchange."""
        if count < 0:
            raise ValueError(f"{site}: negative forward count {count}")
        self.site = site
        agreed = count
        if self.ep_group is not None or (gradient_sync and dist.get_world_size() > 1):
            on_gpu = dist.get_backend() == "nccl"  # NCCL reduces GPU tensors only
            largest = torch.tensor([count], dtype=torch.long, device="cuda" if on_gpu else "cpu")
            with agreement_for(site):  # the debug ledger tells agreements for different passes apart
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            agreed = int(largest.item())
        for observe in self.observers:
            observe(site, count, agreed)
        return agreed
