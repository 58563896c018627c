"""`algo.name=grpo`: on-policy Dr.GRPO, the paper's baseline. No experience pool, so the schedule never leaves
warm-up and every fresh token keeps the PPO clip for the whole run: the loss is GroupRelative's assembly
(`loss_spec`: `algo.ratio`, the clip, `algo.loss_agg_mode`). Its entropy bonus is at the original code's scale
(`algo.entropy_microbatches_ref`), as ExGRPO's: the paper's baseline ran in the same code, and the comparisons here
(conf/paper_ratio_cpu.yaml) take both arms at one scale. A variant built on it does not inherit that
(`GroupRelative.entropy_reference`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from exgrpo_megatron.algo.group_relative import GroupRelative
from exgrpo_megatron.algo.protocol import GradedResponse
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.config.schema import AlgoConfig, TrainerConfig
from exgrpo_megatron.experience.types import GroupOutcome


@register("grpo")
@dataclass(frozen=True)
class GRPO(GroupRelative):
    entropy_reference: ClassVar[bool] = True  # the paper's baseline arm: ExGRPO's entropy scale (docstring)

    @classmethod
    def from_config(cls, name: str, algo: AlgoConfig, trainer: TrainerConfig, max_response_length: int) -> GRPO:
        return cls(**cls.shared_settings(name, algo, max_response_length))

    @property
    def uses_pool(self) -> bool:
        return False

    def pool_outcome(self, qid: int, responses: Sequence[GradedResponse], step: int,
                     collect: bool) -> GroupOutcome | None:
        return None
