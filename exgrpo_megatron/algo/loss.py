"""The parts a policy-gradient loss is assembled from, each a small pure function, and the DP- and
micro-batch-invariant normalisers: the ratio (`log_ratio`: token | sequence), PPO's clip (`Clip`, `clipped_surrogate`;
the surrogate part is chosen by name, algo/surrogates.py), the replay term (`replay_token_loss`, or the truncated-IS
one, `TruncatedISReplay` in algo/policy_loss.py), the truncated IS weight (`truncated_is_weight`) and the aggregation
(`aggregate`). algo/policy_loss.py assembles them; the formulas below are ExGRPO's, the default assembly.

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
    l = -A*w      with algo.settings.policy_shaping=false     (plain unclipped IS: paper Tab. 6 "w/o shaping";
                                                                   the original's off_policy_reshape=no_reshape)
    with algo.settings.replay_tis_cap = C > 0 (no shaping; `TruncatedISReplay`): the fresh-token loss of the phase
      (the spec's surrogate) against pi_old, times u = min(exp(logp_old - logp_behaviour), C) detached -- the ExGRPO
      authors' Megatron port (SU-01): replayed samples carry their recorded log-probs and the ordinary truncated-IS
      path corrects them
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
  seq_mean: sum_i (mean_{t in i} l) / N_seq (every sequence weighs the same; GSPO's), `aggregate` over the micro-batch's
    `Sequences` (packed rows hold several sequences).

Other parts (not ExGRPO's defaults): the clip range may be asymmetric, [1 - clip_ratio, 1 + clip_ratio_high] (DAPO's
clip-higher); the fresh tokens' ratio may be GSPO's sequence ratio (`sequence_log_ratio`).

Entropy bonus (every mode): entropy_normaliser = global valid tokens / M_ref, i.e. the bonus is
    c * M_ref * (global token mean of H),   M_ref = `algo.entropy_microbatches_ref` for ExGRPO, 1 for a variant that
    does not ask for the original's scale (`GroupRelative.normalisers`).
The original's bonus is c * token_mean per micro-batch, SUMMED over its dynamic micro-batches (verl's
`use_dynamic_bsz`: ceil(tokens / 32768) token-balanced micro-batches per GPU), then averaged over ranks: with M
micro-batches of equal token counts that is exactly c * M * the token mean. M depends on the layout (sequences
and tokens per GPU), so we fix it at the paper's layout as a constant, like loss_seqs_per_rank_ref: 64 sequences
per rank of ~2k tokens (a ~250-token prompt + ~1.5-2k-token responses of Qwen2.5-Math-7B) over 32768-token
micro-batches = 4. Our bonus is then the original's at its layout, whatever our GPU count or micro-batching
(`tests/test_loss_scale.py`). M_ref = 1 is the original at one micro-batch per rank (its configured gradient
accumulation).

The replay ratio's denominator on replayed tokens (`select_replay_denominator_logprobs`): with
`replay_is_correction=True` the behaviour log-probs recorded when the trajectory was collected (pi_past), so w is a
true per-token importance ratio; with `replay_is_correction=False` this step's old log-probs (pi_theta_old), so w = 1
on the first mini-batch and f only shapes the ratio (paper Tab. 6, "w/o IS correction").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from exgrpo_megatron.algo.sequences import Sequences

LOSS_AGG_MODES = ("token_sum_constant", "token_mean", "seq_mean")


def loss_normalisers(
    num_tokens_global: float, num_seqs_global: float, mode: str, max_response_length: int,
    seqs_per_rank_ref: float = 1.0, entropy_microbatches_ref: float = 1.0,
) -> tuple[float, float]:
    """(pg_normaliser, entropy_normaliser) from the DP-global valid-token and sequence counts.

    token_sum_constant: (max_response_length * num_seqs_global / seqs_per_rank_ref, num_tokens_global / M_ref)
    token_mean:         (num_tokens_global, num_tokens_global / M_ref)
    seq_mean:           (num_seqs_global, num_tokens_global / M_ref)  (`aggregate` takes each sequence's token mean)
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
    if mode == "seq_mean":
        return max(float(num_seqs_global), 1.0), entropy_normaliser
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
    return torch.where(per_token(replay_mask, old_logprobs).bool(), behaviour_logprobs, old_logprobs)


def shaped_ratio(log_ratio: Tensor, beta: float) -> Tensor:
    """f(w) = w / (w + beta) with w = exp(log_ratio), computed as sigmoid(log w - log beta) so that it stays
    finite for any log_ratio (paper Eq. 4, beta = 0.1). df/dw = beta / (w + beta)^2."""
    if beta <= 0:
        raise ValueError(f"shaping beta must be > 0, got {beta}")
    return torch.sigmoid(log_ratio - math.log(beta))


RATIOS = ("token", "sequence")


def token_log_ratio(logprobs: Tensor, denominator: Tensor, tokens: Tensor) -> Tensor:
    """log rho_t = logp_t - logp_denominator_t on `tokens` (bool [B, T]), 0 elsewhere (never reaches exp())."""
    return torch.where(tokens, logprobs - denominator, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))


def sequence_log_ratio(logprobs: Tensor, denominator: Tensor, tokens: Tensor, sequences: Sequences) -> Tensor:
    """GSPO's sequence-level ratio (Zheng et al. 2025, "Group Sequence Policy Optimization", Eq. 7 and the
    GSPO-token form, Eq. 13-14), per token:
        log s_i = (1/|y_i|) sum_{t in y_i} (logp_t - logp_denominator_t)      (the geometric mean of token ratios)
        log s_i,t = sg[log s_i] + logp_t - sg[logp_t]
    so every token of sequence i carries the value s_i (a clip acts on the whole sequence) and d s_i,t = s_i d logp_t:
    averaged over the sequence's tokens that is exactly d s_i. The mean runs over `tokens` of each sequence as
    `sequences` names them (packed rows hold several sequences: a per-row mean would mix them); 0 off `tokens`."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    per_token = token_log_ratio(logprobs, denominator, tokens)
    log_s = sequences.to_tokens(sequences.means(per_token, tokens))
    return torch.where(tokens, log_s.detach() + logprobs - logprobs.detach(), zero)


def log_ratio(kind: str, logprobs: Tensor, denominator: Tensor, tokens: Tensor, sequences: Sequences) -> Tensor:
    """The ratio part: `token` (PPO / GRPO) or `sequence` (GSPO)."""
    if kind == "token":
        return token_log_ratio(logprobs, denominator, tokens)
    if kind == "sequence":
        return sequence_log_ratio(logprobs, denominator, tokens, sequences)
    raise ValueError(f"unknown ratio {kind!r}; expected one of {RATIOS}")


class Clip(NamedTuple):
    """PPO's clip range of the ratio: [1 - low, 1 + high]. low == high is PPO's symmetric clip (eps = 0.2); high >
    low is DAPO's clip-higher (Yu et al. 2025, §3.1: eps_low 0.2, eps_high 0.28)."""

    low: float
    high: float


def clipped_surrogate(log_ratio: Tensor, advantages: Tensor, clip: Clip | None) -> tuple[Tensor, Tensor]:
    """Per-token loss and a bool mask of tokens where the clipped branch is active.

    rho = exp(log_ratio); clip None: l = -A*rho; else l = max(-A*rho, -A*clip(rho, 1 - clip.low, 1 + clip.high)).
    """
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    if clip is None:
        return unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip.low, 1.0 + clip.high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def replay_weight(log_w: Tensor, beta: float = 0.1, shaping: bool = True) -> Tensor:
    """The weight a replayed token's advantage is multiplied by: f(w) = w / (w + beta) (paper Eq. 4) with
    shaping, the plain importance ratio w = exp(log_w) without (paper Tab. 6, "w/o policy shaping")."""
    return shaped_ratio(log_w, beta) if shaping else torch.exp(log_w)


def replay_token_loss(log_w: Tensor, advantages: Tensor, beta: float = 0.1, shaping: bool = True) -> Tensor:
    """Per-token loss of replayed tokens: l = -A * f(w), or l = -A * w without shaping (`replay_weight`)."""
    return -advantages * replay_weight(log_w, beta, shaping)


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


def aggregate(token_loss: Tensor, sequences: Sequences, mode: str, pg_normaliser: float) -> Tensor:
    """The aggregation part: one micro-batch's policy-gradient loss from its per-token losses (0 off the response).
    token_sum_constant, token_mean: sum_{i,t} l / pg_normaliser (the normaliser says which: `loss_normalisers`);
    seq_mean: sum_i mean_{t in i} l / pg_normaliser (pg_normaliser = the global sequence count: every sequence
    weighs the same whatever its length; GSPO's 1/G sum_i 1/|y_i| sum_t)."""
    if mode == "seq_mean":
        return sequences.means(token_loss).sum() / pg_normaliser
    if mode in ("token_sum_constant", "token_mean"):
        return token_loss.sum() / pg_normaliser
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")


def mult_prob_error_sums(behaviour_logprobs: Tensor, trainer_logprobs: Tensor, valid: Tensor
                         ) -> tuple[Tensor, Tensor]:
    """(sum, count) over the `valid` tokens of exp(|logp_behaviour - logp_trainer|), in float64: the terms of
    metric mismatch/token_mult_prob_error (NeMo-RL's train/inference mismatch alarm: 1.0 when the rollout engine and
    the trainer agree exactly), to be summed over rows, micro-batches and ranks before dividing."""
    mask = valid.bool()
    err = torch.exp((behaviour_logprobs.double() - trainer_logprobs.double()).abs())
    return err[mask].sum(), mask.sum().double()


def per_token(x: Tensor, like: Tensor) -> Tensor:
    """Broadcast a per-sequence [B] tensor to per-token [B, T]; per-token tensors pass through."""
    if x.dim() == like.dim():
        return x
    if x.dim() == 1 and like.dim() == 2 and x.shape[0] == like.shape[0]:
        return x.unsqueeze(-1).expand_as(like)
    raise ValueError(f"cannot broadcast shape {tuple(x.shape)} to per-token shape {tuple(like.shape)}")
