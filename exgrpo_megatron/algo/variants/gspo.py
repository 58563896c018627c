"""`algo.name=gspo`: GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): on-policy GRPO
with the sequence-level importance ratio s_i = exp(mean_{t in y_i} log(pi_theta / pi_old)), clipped per sequence
(the ratio part `sequence`, algo/loss.py `sequence_log_ratio`, in the paper's token-broadcast stop-gradient form) and
a sequence-mean aggregation, J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i): every sequence
weighs the same whatever its length (algo/loss.py `aggregate`, `seq_mean`).

It reads `algo.clip_ratio` / `algo.clip_ratio_high` as eps_low / eps_high of PPO's clip (the paper: 3e-4 / 4e-4; a
sequence ratio is much closer to 1 than a token's) and fixes `algo.ratio` and `algo.loss_agg_mode` (sequence /
seq_mean: they are what GSPO is; the run says so at start-up when the config asks for others). It has no replay term
and no pool. ExGRPO with GSPO's ratio on its fresh tokens: `algo.name=exgrpo algo.ratio=sequence`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.variants.grpo import GRPO


@register("gspo")
@dataclass(frozen=True)
class GSPO(GRPO):
    algo_keys: ClassVar[frozenset[str]] = GRPO.algo_keys - {"ratio", "loss_agg_mode"}
    fixed_algo_keys: ClassVar[Mapping[str, tuple[Any, str]]] = {
        "ratio": ("sequence", "GSPO's ratio is the sequence's (paper Eq. 7)"),
        "loss_agg_mode": ("seq_mean", "GSPO weighs every sequence the same (paper Eq. 5: 1/G sum_i over sequences)"),
    }
