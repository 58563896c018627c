"""The ExGRPO policy loss: pure per-token functions plus a DP- and micro-batch-invariant aggregation.

Sources: paper Eq. 3-4 and §D.1 (mixed-policy objective; clipping removed and policy shaping used in the
mixed phase); docs/exgrpo.md (the code's `compute_token_on_off_policy_loss`). Notation per token t
of sequence i: logp = log pi_theta, A = the sequence's advantage (broadcast over its tokens), m = response
mask (up to and including EOS), P = replay mask (tokens of a replayed trajectory o*).

Per-token loss l_t (no KL term; the original has none):
  fresh tokens (P=0), rho = exp(logp - logp_old):
    warm-up phase:  l = max(-A*rho, -A*clip(rho, 1-eps, 1+eps)),  eps = 0.2  (standard PPO clip)
    mixed phase:    l = -A*rho                                   (unclipped, paper §D.1)
    with algo.fresh_is_cap = C > 0, either phase:  l <- v * l,  v = min(exp(logp_old - logp_gen), C)  detached
                                                   (truncated IS against the rollout engine; `truncated_is_weight`)
  replayed tokens (P=1), w = exp(logp - logp_behaviour):
    l = -A*f(w),  f(w) = w / (w + beta),  beta = 0.1              (policy shaping, Eq. 4)
    l = -A*w      with algo.policy_shaping=false                  (plain unclipped IS: paper Tab. 6 "w/o shaping";
                                                                   the original's off_policy_reshape=no_reshape)
    with algo.replay_tis_cap = C > 0 (no shaping; `replay_truncated_is_loss`): the fresh-token loss of the phase
      against pi_old, times u = min(exp(logp_old - logp_behaviour), C) detached -- the ExGRPO authors' Megatron port
      (SU-01): replayed samples carry their recorded log-probs and the ordinary truncated-IS path corrects them
Total loss of one micro-batch on one rank:
  L_mb = sum_{i,t} m*l / pg_normaliser  -  entropy_coeff * sum_{i,t} m*H / entropy_normaliser

Normalisation contract (NeMo-RL's). The caller counts valid tokens and sequences of the whole
global mini-batch, all-reduced over DP *before* splitting it into micro-batches (`global_loss_counts`), and
derives both normalisers from those global counts (`loss_normalisers`). Each micro-batch then returns its sum
divided by the global normaliser, so summing micro-batch losses over micro-batches and summing (not averaging)
gradients over DP ranks gives exactly the full-batch loss and gradient, for any micro-batch count or DP size.

Aggregation modes:
  token_sum_constant (default): pg_normaliser = max_response_length * num_sequences_global / seqs_per_rank_ref
    (Dr.GRPO "no length normalisation", at the original's scale). The original (`mix_core_alg.py`:
    `pg_loss = (pg_losses * eos_mask).sum() / eos_mask.shape[-1]`, `mix_actor.update_policy`: `loss =
    policy_loss / gradient_accumulation`, FSDP averaging gradients over DP) optimises, per mini-batch,
        L_orig = (1/DP) sum_ranks sum_micro [ sum_{i,t} m*l / T_max  -  c * token_mean_micro(H) ] / grad_accum,
    with grad_accum = ppo_mini_batch_size / ppo_micro_batch_size = 64/64 = 1 in run_exgrpo.sh and verl normalising
    both to per-rank sequences (x n / DP: 64 x 8 / 8 = 64 sequences per rank per mini-batch). Its pg term is
    sum_all l / (T_max * DP) = [sum_all l / (T_max * N_seq)] * (N_seq / DP): it changes with the GPU count at a
    fixed batch. We keep a normaliser that does not depend on the GPU count and put the original's
    sequences-per-rank AT THE PAPER'S LAYOUT in as a constant, `algo.loss_seqs_per_rank_ref` = 64:
        pg = sum_all l * S_ref / (T_max * N_seq)
    which equals the original's pg term at 8 ranks x 512 sequences for any DP size / micro-batching of ours, so
    grad clipping (1.0), the skip bound (500) and the balance against the entropy bonus act on the original's
    gradient scale (`tests/test_loss_scale.py` checks it against a float64 re-implementation of L_orig).
    With loss_seqs_per_rank_ref = 1 this mode is the older sum / (T_max * N_seq) (64x smaller pg at the paper
    layout).
  token_mean: pg_normaliser = number of valid tokens in the global mini-batch (loss_seqs_per_rank_ref unused).

Entropy bonus (both modes): entropy_normaliser = global valid tokens / M_ref, i.e. the bonus is
    c * M_ref * (global token mean of H),   M_ref = `algo.entropy_microbatches_ref`.
The original's bonus is c * token_mean per micro-batch, SUMMED over its dynamic micro-batches (verl's
`use_dynamic_bsz`: ceil(tokens / 32768) token-balanced micro-batches per GPU), then averaged over ranks: with M
micro-batches of equal token counts that is exactly c * M * the token mean. M depends on the layout (sequences
and tokens per GPU), so we fix it at the paper's layout as a constant, like loss_seqs_per_rank_ref: 64 sequences
per rank of ~2k tokens (a ~250-token prompt + ~1.5-2k-token responses of Qwen2.5-Math-7B) over 32768-token
micro-batches = 4. Our bonus is then the original's at its layout, whatever our GPU count or micro-batching
(`tests/test_loss_scale.py`). M_ref = 1 is the original at one micro-batch per rank (its configured gradient
accumulation), which is what this code did before the constant existed.

The replay ratio's denominator on replayed tokens (`select_replay_denominator_logprobs`): with
`replay_is_correction=True` the behaviour log-probs recorded when the trajectory was collected (pi_past), so w is a
true per-token importance ratio; with `replay_is_correction=False` this step's old log-probs (pi_theta_old), so w = 1
on the first mini-batch and f only shapes the ratio (paper Tab. 6, "w/o IS correction").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

LOSS_AGG_MODES = ("token_sum_constant", "token_mean")


def loss_normalisers(
    num_tokens_global: float, num_seqs_global: float, mode: str, max_response_length: int,
    seqs_per_rank_ref: float = 1.0, entropy_microbatches_ref: float = 1.0,
) -> tuple[float, float]:
    """(pg_normaliser, entropy_normaliser) from the DP-global valid-token and sequence counts.

    token_sum_constant: (max_response_length * num_seqs_global / seqs_per_rank_ref, num_tokens_global / M_ref)
    token_mean:         (num_tokens_global, num_tokens_global / M_ref)
    seqs_per_rank_ref = the original's sequences per rank per mini-batch at its layout (`algo.loss_seqs_per_rank_ref`,
    64 for the paper); M_ref = entropy_microbatches_ref, its dynamic micro-batches per rank (4; module docstring).
    Counts of zero are replaced by 1 so an empty batch gives a zero loss, not NaN.
    """
    num_tokens = max(float(num_tokens_global), 1.0)
    if entropy_microbatches_ref <= 0:
        raise ValueError(f"entropy_microbatches_ref must be > 0, got {entropy_microbatches_ref}")
    entropy_normaliser = num_tokens / float(entropy_microbatches_ref)
    if mode == "token_sum_constant":
        if max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
        if seqs_per_rank_ref <= 0:
            raise ValueError(f"seqs_per_rank_ref must be > 0, got {seqs_per_rank_ref}")
        pg_normaliser = float(max_response_length) * max(float(num_seqs_global), 1.0) / float(seqs_per_rank_ref)
        return pg_normaliser, entropy_normaliser
    if mode == "token_mean":
        return num_tokens, entropy_normaliser
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")


def global_loss_counts(response_lengths: Sequence[int], dp_group: dist.ProcessGroup | None = None
                       ) -> tuple[float, float]:
    """(valid tokens, sequences) of this rank's mini-batch, summed over `dp_group`: the response lengths of its
    rows (every row of a training batch has >= 1 response token: an engine emits at least the token that ends
    the response, a stored trajectory is never empty).

    Call it on the whole mini-batch before micro-batching. `dp_group=None` means no reduction (one process);
    under megatron pass the data-parallel group (never the world group: TP/PP ranks of one replica hold the
    same data). The counts travel as a float64 CPU tensor (a gloo group).
    """
    counts = torch.tensor([float(sum(response_lengths)), float(len(response_lengths))], dtype=torch.float64)
    if dp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    num_tokens, num_seqs = counts.tolist()
    return float(num_tokens), float(num_seqs)


def select_replay_denominator_logprobs(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, replay_mask: Tensor, replay_is_correction: bool
) -> Tensor:
    """The replay ratio w's denominator: the behaviour log-probs (a replayed trajectory's recorded pi_past) on
    replayed tokens when `replay_is_correction`, else this step's pi_theta_old everywhere (docs/exgrpo.md)."""
    if not replay_is_correction:
        return old_logprobs
    return torch.where(_per_token(replay_mask, old_logprobs).bool(), behaviour_logprobs, old_logprobs)


def shaped_ratio(log_ratio: Tensor, beta: float) -> Tensor:
    """f(w) = w / (w + beta) with w = exp(log_ratio), computed as sigmoid(log w - log beta) so that it stays
    finite for any log_ratio (paper Eq. 4, beta = 0.1). df/dw = beta / (w + beta)^2."""
    if beta <= 0:
        raise ValueError(f"shaping beta must be > 0, got {beta}")
    return torch.sigmoid(log_ratio - math.log(beta))


def fresh_token_loss(
    log_ratio: Tensor, advantages: Tensor, clip: bool, clip_ratio: float = 0.2
) -> tuple[Tensor, Tensor]:
    """Per-token loss of on-policy tokens and a bool mask of tokens where the clipped branch is active.

    rho = exp(log_ratio); clip=False: l = -A*rho; clip=True: l = max(-A*rho, -A*clip(rho, 1-eps, 1+eps)).
    """
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    if not clip:
        return unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def replay_weight(log_w: Tensor, beta: float = 0.1, shaping: bool = True) -> Tensor:
    """The weight a replayed token's advantage is multiplied by: f(w) = w / (w + beta) (paper Eq. 4) with
    shaping, the plain importance ratio w = exp(log_w) without (paper Tab. 6, "w/o policy shaping")."""
    return shaped_ratio(log_w, beta) if shaping else torch.exp(log_w)


def replay_token_loss(log_w: Tensor, advantages: Tensor, beta: float = 0.1, shaping: bool = True) -> Tensor:
    """Per-token loss of replayed tokens: l = -A * f(w), or l = -A * w without shaping (`replay_weight`)."""
    return -advantages * replay_weight(log_w, beta, shaping)


def replay_truncated_is_loss(log_rho: Tensor, old_logprobs: Tensor, denominator_logprobs: Tensor, advantages: Tensor,
                             cap: float, clip: bool, clip_ratio: float = 0.2) -> tuple[Tensor, Tensor]:
    """Per-token loss of replayed tokens corrected by truncated IS instead of shaped (`algo.replay_tis_cap`):
        l = u * fresh_token_loss(log_rho),  u = min(exp(logp_old - logp_denominator), cap)  detached,
    log_rho = logp - logp_old; the denominator is the trajectory's recorded pi_past (`replay_is_correction`). The
    product's gradient is u * the fresh-token gradient: pi_theta / pi_past truncated at cap * pi_theta / pi_old, the
    truncated-IS estimator of Ionides 2008 as Yao et al. 2025 and slime's `--use-tis` apply it. Returns (loss, the
    weight u)."""
    weight = truncated_is_weight(old_logprobs, denominator_logprobs, cap).weight
    loss, _ = fresh_token_loss(log_rho, advantages, clip=clip, clip_ratio=clip_ratio)
    return loss * weight.to(loss.dtype), weight


class TruncatedIS(NamedTuple):
    """Per-token truncated importance weights of fresh tokens and where the cap bound them."""

    weight: Tensor  # min(pi_old / pi_behaviour, cap), no gradient
    truncated: Tensor  # bool: pi_old / pi_behaviour > cap


def truncated_is_weight(old_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> TruncatedIS:
    """Truncated importance sampling (Ionides 2008) of the trainer's pi_old against the policy that sampled the
    tokens (the rollout engine's log-probs: a different numeric engine, or weights `rollout.max_staleness` steps
    older):
        v = min(exp(logp_old - logp_behaviour), cap),  detached (a constant factor of the token's loss)
    as used for rollout/trainer mismatch and stale rollouts by Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training", verl's rollout correction and slime's `--use-tis`. The cap bounds
    the variance the ratio adds; `truncated` marks the tokens where it binds. Computed in the inputs' dtype."""
    if cap <= 0:
        raise ValueError(f"truncated IS cap must be > 0, got {cap}")
    with torch.no_grad():
        ratio = torch.exp(old_logprobs.detach() - behaviour_logprobs.detach())
        return TruncatedIS(torch.clamp(ratio, max=cap), ratio > cap)


def approx_kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator of KL(pi_old || pi_theta) from tokens sampled under pi_old: exp(r) - 1 - r, r = logp - logp_old."""
    return torch.expm1(log_ratio) - log_ratio


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
    """ExGRPO loss of one micro-batch (formulas in the module docstring).

    logprobs: [B, T] log pi_theta of the response tokens (differentiable).
    old_logprobs: [B, T] this step's pi_theta_old (fresh-token ratio rho, and the KL metric).
    replay_denominator_logprobs: [B, T] log-probs for the replay ratio w (see `select_replay_denominator_logprobs`).
    advantages: [B] per sequence or [B, T] per token. response_mask: [B, T]. replay_mask: [B] or [B, T].
    entropy: [B, T] token entropies (differentiable or not), or None to leave out the entropy bonus.
    mixed_phase: False = warm-up (PPO clip on fresh tokens), True = mixed (unclipped).
    policy_shaping: True = f(w) on replayed tokens, False = the plain ratio w (`replay_weight`).
    replay_tis_cap: > 0: replayed tokens take `replay_truncated_is_loss` instead (policy_shaping unused).
    pg_normaliser, entropy_normaliser: from `loss_normalisers` on DP-global counts.
    fresh_is_weights: `truncated_is_weight` per token [B, T]; fresh tokens' loss is multiplied by its weight
    (replayed tokens keep f(w) against their replay denominator). None: no correction (the weight-free code path).

    Returns (loss, metrics). Metrics are detached float64 scalars meant to be reduced over micro-batches and DP
    ranks: keys ending in `_max` with MAX, all others with SUM; `summarize_loss_metrics` turns them into means.
    Positions outside the response mask never reach exp(), so padding values there are harmless.
    """
    valid = response_mask.bool()
    replay = _per_token(replay_mask, logprobs).bool() & valid
    fresh = valid & ~replay
    adv = _per_token(advantages, logprobs).to(logprobs.dtype)

    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_rho = torch.where(fresh, logprobs - old_logprobs, zero)
    log_w = torch.where(replay, logprobs - replay_denominator_logprobs, zero)

    fresh_loss, clipped = fresh_token_loss(log_rho, adv, clip=not mixed_phase, clip_ratio=clip_ratio)
    if fresh_is_weights is not None:  # 1 off fresh tokens, so padding or replay values never reach the product
        is_weight = torch.where(fresh, fresh_is_weights.weight.detach().to(logprobs.dtype), torch.ones_like(zero))
        is_truncated = fresh_is_weights.truncated.bool() & fresh
        fresh_loss = fresh_loss * is_weight
    else:
        is_weight, is_truncated = torch.zeros_like(zero), torch.zeros_like(fresh)
    if replay_tis_cap > 0:
        log_rho_replay = torch.where(replay, logprobs - old_logprobs, zero)
        replay_loss, tis = replay_truncated_is_loss(
            log_rho_replay, torch.where(replay, old_logprobs, zero),
            torch.where(replay, replay_denominator_logprobs, zero), adv, replay_tis_cap, clip=not mixed_phase,
            clip_ratio=clip_ratio)
        replay_effective = tis * torch.exp(log_rho_replay)
    else:
        replay_loss = replay_token_loss(log_w, adv, beta=shaping_beta, shaping=policy_shaping)
        replay_effective = replay_weight(log_w, shaping_beta, policy_shaping)
    token_loss = torch.where(replay, replay_loss, torch.where(fresh, fresh_loss, zero))
    pg_loss = token_loss.sum() / pg_normaliser
    loss = pg_loss

    if entropy is not None:
        entropy_sum = torch.where(valid, entropy, zero).sum()
        entropy_bonus = entropy_coeff * entropy_sum / entropy_normaliser
        loss = loss - entropy_bonus
    else:
        entropy_sum = entropy_bonus = zero

    with torch.no_grad():
        w = torch.exp(log_w)
        metrics = {
            "pg_loss": pg_loss,
            "entropy_bonus": entropy_bonus,
            "token_count": valid.sum(),
            "fresh_token_count": fresh.sum(),
            "replay_token_count": replay.sum(),
            "clipped_token_count": (clipped & fresh).sum(),
            "fresh_ratio_sum": torch.where(fresh, torch.exp(log_rho), zero).sum(),
            "approx_kl_sum": torch.where(fresh, approx_kl_k3(log_rho), zero).sum(),
            "replay_weight_sum": torch.where(replay, w, zero).sum(),
            "replay_weight_max": torch.where(replay, w, zero).max() if w.numel() else zero,
            "replay_shaped_weight_sum": torch.where(replay, replay_effective, zero).sum(),
            "entropy_sum": entropy_sum,
            "fresh_is_weight_sum": torch.where(fresh, is_weight, zero).sum(),  # 0 without a correction
            "fresh_is_truncated_count": is_truncated.sum(),
        }
        metrics = {k: v.detach().to(torch.float64) for k, v in metrics.items()}
    return loss, metrics


def metric_reduce_op(key: str) -> str:
    """'max' for keys ending in `_max`, else 'sum' (how to combine `exgrpo_loss` metrics)."""
    return "max" if key.endswith("_max") else "sum"


def summarize_loss_metrics(reduced: Mapping[str, float | Tensor]) -> dict[str, float]:
    """Means and fractions from metrics already reduced over micro-batches and DP ranks."""
    v = {k: float(x) for k, x in reduced.items()}

    def ratio(num: str, den: str) -> float:
        return v[num] / v[den] if v[den] > 0 else 0.0

    return {
        "pg_loss": v["pg_loss"],
        "entropy_bonus": v["entropy_bonus"],
        "token_count": v["token_count"],
        "replay_token_fraction": ratio("replay_token_count", "token_count"),
        "clip_fraction": ratio("clipped_token_count", "fresh_token_count"),
        "fresh_ratio_mean": ratio("fresh_ratio_sum", "fresh_token_count"),
        "approx_kl": ratio("approx_kl_sum", "fresh_token_count"),
        "replay_weight_mean": ratio("replay_weight_sum", "replay_token_count"),
        "replay_weight_max": v["replay_weight_max"],
        "replay_shaped_weight_mean": ratio("replay_shaped_weight_sum", "replay_token_count"),
        "entropy_mean": ratio("entropy_sum", "token_count"),
        "fresh_is_weight_mean": ratio("fresh_is_weight_sum", "fresh_token_count"),
        "fresh_is_truncated_fraction": ratio("fresh_is_truncated_count", "fresh_token_count"),
    }


def mult_prob_error_sums(behaviour_logprobs: Tensor, trainer_logprobs: Tensor, valid: Tensor
                         ) -> tuple[Tensor, Tensor]:
    """(sum, count) over the `valid` tokens of exp(|logp_behaviour - logp_trainer|), in float64: the terms of
    `token_mult_prob_error`, to be summed over rows, micro-batches and ranks before dividing."""
    mask = valid.bool()
    err = torch.exp((behaviour_logprobs.double() - trainer_logprobs.double()).abs())
    return err[mask].sum(), mask.sum().double()


def token_mult_prob_error(behaviour_logprobs: Tensor, trainer_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Mean over valid tokens of exp(|logp_behaviour - logp_trainer|) (behaviour: the rollout engine's): 1.0 when
    the rollout engine and the trainer agree exactly; a train/inference mismatch alarm (NeMo-RL's metric)."""
    total, count = mult_prob_error_sums(behaviour_logprobs, trainer_logprobs, response_mask)
    return total / count.clamp(min=1.0)


def _per_token(x: Tensor, like: Tensor) -> Tensor:
    """Broadcast a per-sequence [B] tensor to per-token [B, T]; per-token tensors pass through."""
    if x.dim() == like.dim():
        return x
    if x.dim() == 1 and like.dim() == 2 and x.shape[0] == like.shape[0]:
        return x.unsqueeze(-1).expand_as(like)
    raise ValueError(f"cannot broadcast shape {tuple(x.shape)} to per-token shape {tuple(like.shape)}")
