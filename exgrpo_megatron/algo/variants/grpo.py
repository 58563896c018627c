"""`algo.name=grpo`: on-policy Dr.GRPO, the paper's baseline. No experience pool, so the schedule never leaves
warm-up and every fresh token keeps the PPO clip for the whole run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from exgrpo_megatron.algo.group_relative import GroupRelative
from exgrpo_megatron.algo.loss import exgrpo_loss
from exgrpo_megatron.algo.protocol import ExperienceKnobs, GradedResponse
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.config.schema import AlgoConfig, TrainerConfig
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.experience.types import GroupOutcome


@register("grpo")
@dataclass(frozen=True)
class GRPO(GroupRelative):
    name: str
    adv_std_normalize: bool
    clip_ratio: float
    entropy_coeff: float
    loss_agg_mode: str
    loss_seqs_per_rank_ref: float
    entropy_microbatches_ref: float
    max_response_length: int

    @classmethod
    def from_config(cls, name: str, algo: AlgoConfig, trainer: TrainerConfig, max_response_length: int) -> GRPO:
        return cls(name=name, adv_std_normalize=algo.adv_std_normalize, clip_ratio=algo.clip_ratio,
                   entropy_coeff=algo.entropy_coeff, loss_agg_mode=algo.loss_agg_mode,
                   loss_seqs_per_rank_ref=algo.loss_seqs_per_rank_ref,
                   entropy_microbatches_ref=algo.entropy_microbatches_ref, max_response_length=max_response_length)

    @property
    def experience(self) -> ExperienceKnobs | None:
        return None

    def clips(self, phase: Phase) -> bool:
        return True

    def loss(self, logprobs: Tensor, entropy: Tensor | None, response_mask: Tensor, *, old_logprobs: Tensor,
             generation_logprobs: Tensor, advantages: Tensor, replay: Tensor, phase: Phase,
             normalisers: tuple[float, float]) -> tuple[Tensor, dict[str, Tensor]]:
        """PPO clip on every token (`loss.exgrpo_loss` without replayed rows: `replay` is all zero here)."""
        return exgrpo_loss(logprobs, old_logprobs, old_logprobs, advantages, response_mask, replay, entropy,
                           mixed_phase=not self.clips(phase), clip_ratio=self.clip_ratio,
                           entropy_coeff=self.entropy_coeff, pg_normaliser=normalisers[0],
                           entropy_normaliser=normalisers[1])

    def pool_outcome(self, qid: int, responses: Sequence[GradedResponse], step: int,
                     collect: bool) -> GroupOutcome | None:
        return None
