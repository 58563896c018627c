"""The RL algorithm as one object, and the registry that names its variants in config (`algo.name`).

`Algorithm` owns what the paper defines and ablates (shared/docs/exgrpo_algorithm.md §1-§3): the choice of
behaviour log-probs for the replay ratio (IS correction, `exp_is_correct`), the loss normalisers, the loss of each
phase (warm-up: PPO clip on fresh tokens; collecting / mixed: unclipped, replayed tokens shaped by f(w)), the
metrics the loss declares, and -- when experience is on -- the pool's knobs (`ExperienceKnobs`: rho, the delayed
start, question selection mu / sigma / bucket weights, the trajectory selection rule). `build_algorithm` is the one
place those config values are read.

Variants (`config.schema.ALGORITHMS`): exgrpo = experience on; grpo = on-policy Dr.GRPO, the same object with
experience off
(no pool, so the schedule never leaves warm-up and the fresh tokens keep the clip for the whole run).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from exgrpo_megatron.algo.loss import (
    exgrpo_loss,
    loss_normalisers,
    metric_reduce_op,
    mult_prob_error_sums,
    select_behaviour_logprobs,
    summarize_loss_metrics,
)
from exgrpo_megatron.config.schema import ALGORITHMS, AlgoConfig, TrainerConfig
from exgrpo_megatron.experience.schedule import Phase


@dataclass(frozen=True)
class ExperienceKnobs:
    """The experience pool's knobs (paper §4.1-4.2; config: trainer.experience_* / trainer.exp_*)."""

    ratio: float  # rho: share of the batch drawn from the pool
    start_sratio: float  # delayed start: mixed mode once a step's solved fraction exceeds this (<= 0: step 1)
    lbound: int  # a question is replayable iff lbound < k <= rbound
    rbound: int
    max_trajectories_per_question: int  # 0 = no cap
    bucket_manager: str  # question selection: bucket weights normal | uniform | linear | sqrt
    bucket_mu: float
    bucket_sigma: float
    metric: str  # trajectory selection: ent | ppl | random
    select_mode: str  # argmin (paper) | argmax (Tab. 6 "highest entropy")


@dataclass(frozen=True)
class Algorithm:
    name: str
    experience: ExperienceKnobs | None  # None: on-policy (no pool)
    adv_std_normalize: bool
    clip_ratio: float
    shaping_beta: float
    policy_shaping: bool
    mixed_phase_clip: bool
    exp_is_correct: bool
    entropy_coeff: float
    loss_agg_mode: str
    loss_seqs_per_rank_ref: float
    entropy_microbatches_ref: float
    max_response_length: int

    def clips(self, phase: Phase) -> bool:
        """PPO clip on fresh tokens: in warm-up only (paper §D.1: the mixed phase is unclipped), unless
        `algo.mixed_phase_clip` keeps it in every phase."""
        return phase is Phase.WARMUP or self.mixed_phase_clip

    def normalisers(self, num_tokens_global: float, num_seqs_global: float) -> tuple[float, float]:
        """(pg, entropy) normalisers of one mini-batch from its DP-global counts (`loss.global_loss_counts`)."""
        return loss_normalisers(num_tokens_global, num_seqs_global, self.loss_agg_mode, self.max_response_length,
                                self.loss_seqs_per_rank_ref, self.entropy_microbatches_ref)

    def behaviour_logprobs(self, old_logprobs: Tensor, recorded_logprobs: Tensor, replay: Tensor) -> Tensor:
        """The replay ratio's denominator: recorded pi_past on replayed tokens with IS correction, else pi_old."""
        return select_behaviour_logprobs(old_logprobs, recorded_logprobs, replay, self.exp_is_correct)

    def loss(self, logprobs: Tensor, entropy: Tensor | None, response_mask: Tensor, *, old_logprobs: Tensor,
             generation_logprobs: Tensor, advantages: Tensor, replay: Tensor, phase: Phase,
             normalisers: tuple[float, float], measure_mismatch: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's loss and summable metrics (`loss.exgrpo_loss`). `generation_logprobs`: the engine's,
        on replayed rows the recorded behaviour log-probs. `measure_mismatch` (weights still pi_old's): also
        mismatch_sum / mismatch_count of exp(|logp_generation - logp|) over fresh tokens."""
        behaviour = self.behaviour_logprobs(old_logprobs, generation_logprobs, replay)
        loss, metrics = exgrpo_loss(
            logprobs, old_logprobs, behaviour, advantages, response_mask, replay, entropy,
            mixed_phase=not self.clips(phase), clip_ratio=self.clip_ratio, shaping_beta=self.shaping_beta,
            policy_shaping=self.policy_shaping, entropy_coeff=self.entropy_coeff,
            pg_normaliser=normalisers[0], entropy_normaliser=normalisers[1])
        if measure_mismatch:
            fresh = response_mask.bool() & ~replay.bool()
            total, count = mult_prob_error_sums(generation_logprobs, logprobs.detach(), fresh)
            metrics = {**metrics, "mismatch_sum": total, "mismatch_count": count}
        return loss, metrics

    @staticmethod
    def metric_reduce_op(key: str) -> str:
        """How a loss metric combines over micro-batches and DP ranks: 'max' or 'sum'."""
        return metric_reduce_op(key)

    @staticmethod
    def step_metrics(reduced: dict[str, float]) -> dict[str, float]:
        """The metrics the algorithm declares, from its loss metrics reduced over the step (0.0 when no update
        ran a loss)."""
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
        }


def build_algorithm(a: AlgoConfig, t: TrainerConfig, max_response_length: int) -> Algorithm:
    """The algorithm named by `algo.name`, with every knob it reads (the one place they are read)."""
    if a.name not in ALGORITHMS:
        raise ValueError(f"algo.name: expected one of {sorted(ALGORITHMS)}, got {a.name!r}")
    knobs = ExperienceKnobs(
        ratio=t.experience_ratio, start_sratio=t.experience_start_sratio, lbound=t.experience_lbound,
        rbound=t.experience_rbound, max_trajectories_per_question=t.exp_max_trajectories_per_question,
        bucket_manager=t.exp_bucket_manager, bucket_mu=t.exp_bucket_mu, bucket_sigma=t.exp_bucket_sigma,
        metric=t.exp_metric, select_mode=t.exp_select_mode) if ALGORITHMS[a.name] else None
    return Algorithm(
        name=a.name, experience=knobs, adv_std_normalize=a.adv_std_normalize, clip_ratio=a.clip_ratio,
        shaping_beta=a.shaping_beta, policy_shaping=a.policy_shaping, mixed_phase_clip=a.mixed_phase_clip,
        exp_is_correct=a.exp_is_correct,
        entropy_coeff=a.entropy_coeff, loss_agg_mode=a.loss_agg_mode, loss_seqs_per_rank_ref=a.loss_seqs_per_rank_ref,
        entropy_microbatches_ref=a.entropy_microbatches_ref, max_response_length=max_response_length)
