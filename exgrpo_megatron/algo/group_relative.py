"""What the group-relative policy-gradient variants share (GRPO, ExGRPO and those built on them): their common
settings (read from the config in one place, `shared_settings`), group-mean advantages, keep-every-group, the loss
normalisers, the truncated importance weights of fresh tokens and the declared step metrics. A variant adds its
own fields and overrides what it changes (algo/variants/)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from exgrpo_megatron.algo.advantages import group_advantages
from exgrpo_megatron.algo.loss import (
    TruncatedIS,
    loss_normalisers,
    metric_reduce_op,
    summarize_loss_metrics,
    truncated_is_weight,
)
from exgrpo_megatron.config.schema import AlgoConfig


@dataclass(frozen=True)
class GroupRelative:
    """The shared settings and methods; a variant is a frozen dataclass subclass adding its own fields."""

    name: str
    adv_std_normalize: bool
    clip_ratio: float
    entropy_coeff: float
    loss_agg_mode: str
    loss_seqs_per_rank_ref: float
    entropy_microbatches_ref: float
    max_response_length: int
    fresh_is_cap: float  # > 0: fresh tokens' loss x min(pi_old / pi_engine, cap); 0: off
    filters_groups = False

    @staticmethod
    def shared_settings(name: str, algo: AlgoConfig, max_response_length: int) -> dict[str, Any]:
        """The shared fields' values from the config (the one place they are read)."""
        return dict(name=name, adv_std_normalize=algo.adv_std_normalize, clip_ratio=algo.clip_ratio,
                    entropy_coeff=algo.entropy_coeff, loss_agg_mode=algo.loss_agg_mode,
                    loss_seqs_per_rank_ref=algo.loss_seqs_per_rank_ref,
                    entropy_microbatches_ref=algo.entropy_microbatches_ref, max_response_length=max_response_length,
                    fresh_is_cap=algo.fresh_is_cap)

    def advantages(self, rewards: Tensor) -> Tensor:
        """A_i = r_i - mean_{j in G} r_j (Dr.GRPO), divided by the group std with `algo.adv_std_normalize`."""
        return group_advantages(rewards, std_normalize=self.adv_std_normalize)

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """Every group is trained on (no filter)."""
        return True

    def normalisers(self, num_tokens_global: float, num_seqs_global: float) -> tuple[float, float]:
        return loss_normalisers(num_tokens_global, num_seqs_global, self.loss_agg_mode, self.max_response_length,
                                self.loss_seqs_per_rank_ref, self.entropy_microbatches_ref)

    def fresh_is_weights(self, old_logprobs: Tensor, behaviour_logprobs: Tensor, replay: Tensor
                         ) -> TruncatedIS | None:
        """Truncated IS weights of fresh tokens, min(exp(logp_old - logp_behaviour), fresh_is_cap)
        (`loss.truncated_is_weight`); None when the cap is 0. `replay` ([B] or [B, T]) marks the rows whose
        `behaviour_logprobs` are a replayed trajectory's recorded ones, not the engine's: their weight is 1 (the loss
        applies the weight to fresh tokens only)."""
        if self.fresh_is_cap <= 0:
            return None
        rep = replay if replay.dim() == old_logprobs.dim() else replay.unsqueeze(-1).expand_as(old_logprobs)
        fresh_behaviour = torch.where(rep.bool(), old_logprobs, behaviour_logprobs)
        return truncated_is_weight(old_logprobs, fresh_behaviour, self.fresh_is_cap)

    def metric_reduce_op(self, key: str) -> str:
        return metric_reduce_op(key)

    def step_metrics(self, reduced: dict[str, float]) -> dict[str, float]:
        """The declared metrics from the loss metrics reduced over the step (0.0 when no update ran a loss)."""
        loss = summarize_loss_metrics(reduced) if "pg_loss" in reduced else {}
        return {
            "loss/policy": loss.get("pg_loss", 0.0),
            "loss/entropy_bonus": loss.get("entropy_bonus", 0.0),
            "entropy/mean": loss.get("entropy_mean", 0.0),
            "replay/is_weight_mean": loss.get("replay_weight_mean", 0.0),
            "replay/is_weight_max": loss.get("replay_weight_max", 0.0),
            "replay/shaped_weight_mean": loss.get("replay_shaped_weight_mean", 0.0),
            "replay/token_fraction": loss.get("replay_token_fraction", 0.0),
            "loss/clip_fraction": loss.get("clip_fraction", 0.0),
            "loss/approx_kl": loss.get("approx_kl", 0.0),
            "rollout/is_weight_mean": loss.get("fresh_is_weight_mean", 0.0),
            "rollout/is_truncated_fraction": loss.get("fresh_is_truncated_fraction", 0.0),
        }
