"""One micro-batch's policy-gradient loss assembled from the parts of algo/loss.py, as a `LossSpec` names them.

    fresh tokens:    l = spec.surrogate(log_ratio(spec.ratio), A; spec.trust_region)  [x truncated IS weight]
    replayed tokens: l = spec.replay's term (ExGRPO: -A * f(w), w against the replay denominator; with
                     algo.settings.replay_tis_cap the spec's surrogate x truncated IS against the recorded log-probs)
    L_mb = aggregate(l, spec.aggregation) - entropy_coeff * sum_{i,t} m*H / entropy_normaliser

`LossBatch` is what the loss reads of one micro-batch: the per-token inputs and which sequence each token belongs to
(`Sequences`, right under padding and packing alike). The metrics a loss returns are the ones algo/loss_metrics.py
declares for its spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from exgrpo_megatron.algo.loss import (
    TruncatedIS,
    aggregate,
    approx_kl_k3,
    log_ratio,
    per_token,
    replay_token_loss,
    replay_weight,
    token_log_ratio,
    truncated_is_weight,
)
from exgrpo_megatron.algo.sequences import Sequences
from exgrpo_megatron.algo.surrogates import Surrogate, SurrogateInputs


@dataclass(frozen=True)
class LossBatch:
    """The loss inputs of one micro-batch, per token [B, T] aligned like the response mask (0 outside it)."""

    logprobs: Tensor  # log pi_theta (differentiable)
    entropy: Tensor | None  # token entropies, None: no entropy bonus
    response_mask: Tensor
    old_logprobs: Tensor  # pi_theta_old
    behaviour_logprobs: Tensor  # the policy that generated the response: the engine's; a replayed row's recorded ones
    advantages: Tensor  # [B] per row (padded only) or [B, T] per token
    replay: Tensor  # [B] or [B, T]: 1 on replayed trajectories
    sequences: Sequences  # each token's sequence (packed rows hold several)

    @classmethod
    def rows(cls, logprobs: Tensor, entropy: Tensor | None, response_mask: Tensor, *, old_logprobs: Tensor,
             behaviour_logprobs: Tensor, advantages: Tensor, replay: Tensor) -> LossBatch:
        """A padded batch: one sequence per row."""
        return cls(logprobs, entropy, response_mask, old_logprobs, behaviour_logprobs, advantages, replay,
                   Sequences.rows(response_mask))


class ReplayInputs(NamedTuple):
    """What a replay term reads of one micro-batch, per token [B, T]."""

    logprobs: Tensor  # log pi_theta (differentiable)
    old_logprobs: Tensor  # pi_theta_old
    denominator: Tensor  # the replay ratio's denominator (`select_replay_denominator_logprobs`)
    advantages: Tensor
    tokens: Tensor  # bool: the replayed tokens (the values elsewhere are discarded)
    sequences: Sequences


@dataclass(frozen=True)
class ShapedReplay:
    """ExGRPO's replay term: replayed tokens' l = -A * f(w), f(w) = w / (w + beta) with shaping (paper Eq. 4), the
    plain ratio w without (paper Tab. 6 "w/o shaping"); w = exp(logp - the replay denominator)."""

    beta: float = 0.1
    shaping: bool = True

    def token_loss(self, r: ReplayInputs, ratio: str, surrogate: Surrogate, trust_region: bool
                   ) -> tuple[Tensor, Tensor]:
        """(per-token loss, the weight A is multiplied by: f(w) or w); the surrogate is not applied."""
        log_w = token_log_ratio(r.logprobs, r.denominator, r.tokens)
        return replay_token_loss(log_w, r.advantages, self.beta, self.shaping), replay_weight(log_w, self.beta,
                                                                                             self.shaping)


@dataclass(frozen=True)
class TruncatedISReplay:
    """The truncated-IS replay term (`algo.settings.replay_tis_cap` > 0): replayed tokens take the fresh-token loss --
    the spec's surrogate of the spec's ratio against pi_old, in the phase's trust region -- times
    u = min(exp(logp_old - logp_denominator), cap) detached (`loss.truncated_is_weight`), no shaping; its weight is
    u * rho. The product's gradient is u x the fresh-token gradient: truncated IS (Ionides 2008) of pi_old against
    the trajectory's recorded pi_past, as the ExGRPO authors' Megatron port (SU-01) and slime's `--use-tis` apply it."""

    cap: float

    def token_loss(self, r: ReplayInputs, ratio: str, surrogate: Surrogate, trust_region: bool
                   ) -> tuple[Tensor, Tensor]:
        zero = torch.zeros((), dtype=r.logprobs.dtype, device=r.logprobs.device)
        log_rho = log_ratio(ratio, r.logprobs, r.old_logprobs, r.tokens, r.sequences)
        u = truncated_is_weight(torch.where(r.tokens, r.old_logprobs, zero), torch.where(r.tokens, r.denominator, zero),
                                self.cap).weight
        fresh_form = surrogate.token_loss(
            SurrogateInputs(log_rho, token_log_ratio(r.logprobs, r.old_logprobs, r.tokens), r.advantages),
            trust_region)
        return fresh_form.loss * u.to(fresh_form.loss.dtype), u * torch.exp(log_rho)


ReplayTerm = ShapedReplay | TruncatedISReplay


@dataclass(frozen=True)
class LossSpec:
    """Which parts a loss is assembled from."""

    ratio: str  # fresh tokens' ratio: token | sequence (`loss.log_ratio`)
    surrogate: Surrogate  # how a token's ratio and advantage become its loss (algo/surrogates.py)
    trust_region: bool  # the phase keeps the surrogate's trust region (PPO's clip); False: ExGRPO's mixed phase
    aggregation: str  # token_sum_constant | token_mean | seq_mean (`loss.aggregate`)
    replay: ReplayTerm | None  # None: no replay term (a replayed row is an error) and no replay metrics
    entropy_coeff: float


def policy_loss(batch: LossBatch, spec: LossSpec, normalisers: tuple[float, float], *,
                replay_denominator: Tensor | None = None, fresh_is: TruncatedIS | None = None
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, metrics) of one micro-batch. `normalisers`: (pg, entropy) from DP-global counts (`loss_normalisers`);
    `replay_denominator`: [B, T] log-probs of the replay ratio's denominator (needed with a replay term);
    `fresh_is`: the fresh tokens' truncated IS weights (None: no correction).

    Metrics are detached float64 scalars, summed over micro-batches and DP ranks except keys ending in `_max`
    (MAX); algo/loss_metrics.py turns them into the step's means. Positions outside the response mask never reach
    exp(), so padding values there are harmless."""
    logprobs = batch.logprobs
    valid = batch.response_mask.bool()
    replay = per_token(batch.replay, logprobs).bool() & valid
    if spec.replay is None and bool(replay.any()):
        raise ValueError("a loss without a replay term got replayed rows")
    fresh = valid & ~replay
    adv = per_token(batch.advantages, logprobs).to(logprobs.dtype)

    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_rho = log_ratio(spec.ratio, logprobs, batch.old_logprobs, fresh, batch.sequences)
    token_log_rho = log_rho if spec.ratio == "token" else token_log_ratio(logprobs, batch.old_logprobs, fresh)
    fresh_loss, surrogate_terms = spec.surrogate.token_loss(SurrogateInputs(log_rho, token_log_rho, adv),
                                                            spec.trust_region)
    if fresh_is is not None:  # 1 off fresh tokens, so padding or replay values never reach the product
        is_weight = torch.where(fresh, fresh_is.weight.detach().to(logprobs.dtype), torch.ones_like(zero))
        is_truncated = fresh_is.truncated.bool() & fresh
        fresh_loss = fresh_loss * is_weight
    else:
        is_weight, is_truncated = torch.zeros_like(zero), torch.zeros_like(fresh)
    if spec.replay is not None:
        if replay_denominator is None:
            raise ValueError("a loss with a replay term needs the replay denominator log-probs")
        log_w = token_log_ratio(logprobs, replay_denominator, replay)
        replay_loss, replay_effective = spec.replay.token_loss(
            ReplayInputs(logprobs, batch.old_logprobs, replay_denominator, adv, replay, batch.sequences),
            spec.ratio, spec.surrogate, spec.trust_region)
        token_loss = torch.where(replay, replay_loss, torch.where(fresh, fresh_loss, zero))
    else:
        token_loss = torch.where(fresh, fresh_loss, zero)
    pg_loss = aggregate(token_loss, batch.sequences, spec.aggregation, normalisers[0])
    loss = pg_loss

    if batch.entropy is not None:
        entropy_sum = torch.where(valid, batch.entropy, zero).sum()
        entropy_bonus = spec.entropy_coeff * entropy_sum / normalisers[1]
        loss = loss - entropy_bonus
    else:
        entropy_sum = entropy_bonus = zero

    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss,
            "entropy_bonus": entropy_bonus,
            "token_count": valid.sum(),
            "fresh_token_count": fresh.sum(),
            **{key: torch.where(fresh, term, torch.zeros_like(term)).sum() for key, term in surrogate_terms.items()},
            "fresh_ratio_sum": torch.where(fresh, torch.exp(log_rho), zero).sum(),
            "approx_kl_sum": torch.where(fresh, approx_kl_k3(token_log_rho), zero).sum(),
            "entropy_sum": entropy_sum,
            "fresh_is_weight_sum": torch.where(fresh, is_weight, zero).sum(),  # 0 without a correction
            "fresh_is_truncated_count": is_truncated.sum(),
        }
        if spec.replay is not None:
            w = torch.exp(log_w)
            metrics.update({
                "replay_token_count": replay.sum(),
                "replay_weight_sum": torch.where(replay, w, zero).sum(),
                "replay_weight_max": torch.where(replay, w, zero).max() if w.numel() else zero,
                "replay_shaped_weight_sum": torch.where(replay, replay_effective, zero).sum(),
            })
        metrics = {k: v.detach().to(torch.float64) for k, v in metrics.items()}
    return loss, metrics
