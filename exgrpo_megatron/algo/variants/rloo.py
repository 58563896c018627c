"""`algo.name=rloo`: on-policy GRPO with the leave-one-out baseline (RLOO, Ahmadian et al. 2024):
A_i = r_i - mean_{j != i} r_j = K / (K - 1) * (r_i - mean_j r_j), no std division (algo.adv_std_normalize is
not read: setting it is refused at start-up). Everything else is GRPO's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.variants.grpo import GRPO


@register("rloo")
@dataclass(frozen=True)
class RLOO(GRPO):
    algo_keys: ClassVar[frozenset[str]] = GRPO.algo_keys - {"adv_std_normalize"}

    def advantages(self, rewards: Tensor) -> Tensor:
        """rewards [G, K] (K >= 2) -> r_i minus the mean of the other K - 1 rewards of its group."""
        if rewards.dim() != 2 or rewards.shape[1] < 2:
            raise ValueError(f"RLOO needs groups of >= 2 rewards, got shape {tuple(rewards.shape)}")
        k = rewards.shape[1]
        others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)
        return rewards - others_mean
