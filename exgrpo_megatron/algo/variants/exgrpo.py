"""`algo.name=exgrpo`: ExGRPO (arXiv 2510.02245) -- GRPO with an experience pool whose replayed trajectories
train through policy shaping.

It owns what the paper defines and ablates: the denominator of the replay ratio (importance-sampling
correction, `algo.replay_is_correction`), the loss of each phase (warm-up: PPO clip on fresh tokens; collecting /
mixed: unclipped, replayed tokens shaped by f(w): the replay term; algo/loss.py, assembled by
`GroupRelative.loss_spec`), the pool's knobs (`ExperienceKnobs`: rho, the delayed start, question selection
mu / sigma / bucket weights, the trajectory selection rule) and what the pool learns from a group (`pool_outcome`).

The fresh tokens' ratio may be GSPO's sequence ratio (`algo.ratio=sequence`): a replayed trajectory is a whole
sequence of its own, so the sequence ratio of a fresh sequence never mixes in replayed tokens and the replay term is
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from exgrpo_megatron.algo.group_relative import GroupRelative
from exgrpo_megatron.algo.loss import select_replay_denominator_logprobs
from exgrpo_megatron.algo.policy_loss import ReplayTerm
from exgrpo_megatron.algo.protocol import ExperienceKnobs, GradedResponse
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.config.schema import AlgoConfig, TrainerConfig
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.experience.types import GroupOutcome


def experience_knobs(t: TrainerConfig) -> ExperienceKnobs:
    return ExperienceKnobs(
        ratio=t.experience_ratio, delayed_start_pass_rate=t.delayed_start_pass_rate,
        replayable_correct_above=t.replayable_correct_above, replayable_correct_at_most=t.replayable_correct_at_most,
        max_trajectories_per_question=t.exp_max_trajectories_per_question,
        bucket_manager=t.exp_bucket_manager, bucket_mu=t.exp_bucket_mu, bucket_sigma=t.exp_bucket_sigma,
        metric=t.exp_metric, select_mode=t.exp_select_mode)


@register("exgrpo")
@dataclass(frozen=True)
class ExGRPO(GroupRelative):
    experience: ExperienceKnobs
    shaping_beta: float
    policy_shaping: bool
    mixed_phase_clip: bool
    replay_is_correction: bool

    @classmethod
    def from_config(cls, name: str, algo: AlgoConfig, trainer: TrainerConfig, max_response_length: int) -> ExGRPO:
        return cls(**cls.shared_settings(name, algo, max_response_length), experience=experience_knobs(trainer),
                   shaping_beta=algo.shaping_beta, policy_shaping=algo.policy_shaping,
                   mixed_phase_clip=algo.mixed_phase_clip, replay_is_correction=algo.replay_is_correction)

    def clips(self, phase: Phase) -> bool:
        """PPO clip on fresh tokens: in warm-up only (paper §D.1: the mixed phase is unclipped), unless
        `algo.mixed_phase_clip` keeps it in every phase."""
        return phase is Phase.WARMUP or self.mixed_phase_clip

    @property
    def replay_term(self) -> ReplayTerm:
        """-A * f(w) on replayed tokens, f(w) = w / (w + `algo.shaping_beta`); the plain w without
        `algo.policy_shaping`."""
        return ReplayTerm(self.shaping_beta, self.policy_shaping)

    def replay_denominator_logprobs(self, old_logprobs: Tensor, behaviour_logprobs: Tensor, replay: Tensor) -> Tensor:
        """The replay ratio's denominator: recorded pi_past on replayed tokens with IS correction, else pi_old."""
        return select_replay_denominator_logprobs(old_logprobs, behaviour_logprobs, replay, self.replay_is_correction)

    def pool_outcome(self, qid: int, responses: Sequence[GradedResponse], step: int,
                     collect: bool) -> GroupOutcome | None:
        """k correct of K; the correct trajectories only once the schedule collects (the original collects
        nothing during warm-up), retirement (k == K) always."""
        k = int(sum(r.reward == 1.0 for r in responses))
        if not collect and k != len(responses):
            return None
        correct = [r for r in responses if r.reward == 1.0] if collect else []
        return GroupOutcome(qid=qid, k_correct=k, group_size=len(responses), step=step,
                            correct_token_ids=[r.token_ids for r in correct],
                            correct_logprobs=[r.logprobs for r in correct])
