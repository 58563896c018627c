"""`algo.name=gspo`: GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): on-policy GRPO
with the sequence-level importance ratio s_i = exp(mean_{t in y_i} log(pi_theta / pi_old)), clipped per sequence
(the ratio part `sequence`, algo/loss.py `sequence_log_ratio`, in the paper's token-broadcast stop-gradient form) and
a sequence-mean aggregation, J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i): every sequence
weighs the same whatever its length (algo/loss.py `aggregate`, `seq_mean`).

It reads `algo.clip_ratio` / `algo.clip_ratio_high` as eps_low / eps_high (the paper: 3e-4 / 4e-4; a sequence
ratio is much closer to 1 than a token's) and ignores `algo.ratio` and `algo.loss_agg_mode` (always sequence /
seq_mean). It has no replay term and no pool. ExGRPO with GSPO's ratio on its fresh tokens: `algo.name=exgrpo
algo.ratio=sequence`.
"""

from __future__ import annotations

from dataclasses import dataclass

from exgrpo_megatron.algo.policy_loss import ReplayTerm
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.variants.grpo import GRPO
from exgrpo_megatron.config.schema import AlgoConfig, TrainerConfig


@register("gspo")
@dataclass(frozen=True)
class GSPO(GRPO):
    @classmethod
    def from_config(cls, name: str, algo: AlgoConfig, trainer: TrainerConfig, max_response_length: int) -> GSPO:
        settings = cls.shared_settings(name, algo, max_response_length)
        return cls(**{**settings, "ratio": "sequence", "loss_agg_mode": "seq_mean"})

    @property
    def replay_term(self) -> ReplayTerm | None:
        return None
