"""ExGRPO's loss of a padded micro-batch with every argument spelled out: the float64-reference tests' entry to
`policy_loss` (the trainer builds the same `LossSpec` through the algorithm)."""

from __future__ import annotations

from torch import Tensor

from exgrpo_megatron.algo.loss import Clip, TruncatedIS
from exgrpo_megatron.algo.policy_loss import (
    LossBatch,
    LossSpec,
    ReplayTerm,
    ShapedReplay,
    TruncatedISReplay,
    policy_loss,
)
from exgrpo_megatron.algo.surrogates import PPOClip


def exgrpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    replay_denominator_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    replay_mask: Tensor,
    entropy: Tensor | None,
    *,
    mixed_phase: bool,
    clip_ratio: float = 0.2,
    shaping_beta: float = 0.1,
    policy_shaping: bool = True,
    replay_tis_cap: float = 0.0,
    entropy_coeff: float = 0.001,
    pg_normaliser: float,
    entropy_normaliser: float,
    fresh_is_weights: TruncatedIS | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ExGRPO's loss of a padded micro-batch (one sequence per row; formulas in algo/loss.py's docstring): token
    ratio, PPO clip `clip_ratio` outside the mixed phase, the shaped replay term, token-sum aggregation over
    `pg_normaliser`; with `replay_tis_cap` > 0 the truncated-IS replay term instead (`policy_shaping` unused).
    `replay_mask`: [B] or [B, T]; `advantages`: [B] or [B, T]."""
    replay: ReplayTerm = (TruncatedISReplay(replay_tis_cap) if replay_tis_cap > 0
                          else ShapedReplay(shaping_beta, policy_shaping))
    batch = LossBatch.rows(logprobs, entropy, response_mask, old_logprobs=old_logprobs,
                           behaviour_logprobs=replay_denominator_logprobs, advantages=advantages, replay=replay_mask)
    spec = LossSpec(ratio="token", surrogate=PPOClip(Clip(clip_ratio, clip_ratio)), trust_region=not mixed_phase,
                    aggregation="token_sum_constant", replay=replay, entropy_coeff=entropy_coeff)
    return policy_loss(batch, spec, (pg_normaliser, entropy_normaliser),
                       replay_denominator=replay_denominator_logprobs, fresh_is=fresh_is_weights)
