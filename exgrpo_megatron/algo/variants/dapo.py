"""`algo.name=dapo`: on-policy GRPO with DAPO's dynamic sampling (Yu et al. 2025, §3.2): a group whose K rewards
are all equal has zero advantage everywhere, so it is dropped and the batch refilled with fresh groups (at most
`algo.max_refill_rounds` extra generation rounds; rollout/group_filter.py). DAPO's other changes are not part of
this variant (token-level loss: `algo.loss_agg_mode=token_mean`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.variants.grpo import GRPO


@register("dapo")
@dataclass(frozen=True)
class DAPO(GRPO):
    filters_groups = True

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """Keep a group unless all its rewards are equal (zero variance)."""
        return len(set(rewards)) > 1
