"""`algo.name=grpo`: on-policy Dr.GRPO, the paper's baseline. No experience pool, so the schedule never leaves
warm-up and every fresh token keeps the PPO clip for the whole run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from exgrpo_megatron.algo.group_relative import GroupRelative
from exgrpo_megatron.algo.loss import exgrpo_loss
from exgrpo_megatron.algo.protocol import GradedResponse
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.config.schema import AlgoConfig, TrainerConfig
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.experience.types import GroupOutcome


@register("grpo")
@dataclass(frozen=True)
class GRPO(GroupRelative):
    @classmethod
    def from_config(cls, name: str, algo: AlgoConfig, trainer: TrainerConfig, max_response_length: int) -> GRPO:
        return cls(**cls.shared_settings(name, algo, max_response_length))

    @property
    def uses_pool(self) -> bool:
        return False

    def clips(self, phase: Phase) -> bool:
        return True

    def loss(self, logprobs: Tensor, entropy: Tensor | None, response_mask: Tensor, *, old_logprobs: Tensor,
             behaviour_logprobs: Tensor, advantages: Tensor, replay: Tensor, phase: Phase,
             normalisers: tuple[float, float]) -> tuple[Tensor, dict[str, Tensor]]:
        """PPO clip on every token (`loss.exgrpo_loss` without replayed rows: `replay` is all zero here); fresh
        tokens weighted by truncated IS against the engine's log-probs with `algo.fresh_is_cap` > 0."""
        return exgrpo_loss(logprobs, old_logprobs, old_logprobs, advantages, response_mask, replay, entropy,
                           mixed_phase=not self.clips(phase), clip_ratio=self.clip_ratio,
                           entropy_coeff=self.entropy_coeff, pg_normaliser=normalisers[0],
                           entropy_normaliser=normalisers[1],
                           fresh_is_weights=self.fresh_is_weights(old_logprobs, behaviour_logprobs, replay))

    def pool_outcome(self, qid: int, responses: Sequence[GradedResponse], step: int,
                     collect: bool) -> GroupOutcome | None:
        return None
