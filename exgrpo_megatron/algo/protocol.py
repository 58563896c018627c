"""What an RL algorithm is to the trainer: the `RLAlgorithm` protocol, one implementation per file.

The trainer asks the algorithm, and nothing else, for
  * `advantages(rewards)`: the per-sequence advantages of groups of K rewards ([G, K] float64 -> [G, K]);
  * `keep_group(rewards)`: the group filter -- a group it drops is not trained on; the trainer refills the batch
    with fresh groups (at most `algo.max_refill_rounds` extra generation rounds) and the dropped group still
    reaches the experience pool (retirement and buckets count every graded group);
  * `loss(batch, ...)`: one micro-batch's loss and summable metrics from its `LossBatch` (the current
    log-probs and entropy, pi_old, the behaviour log-probs -- those of the policy that generated the response:
    the engine's, or a replayed trajectory's recorded ones --, the advantage, the replay flag, and which sequence
    each token belongs to: packed rows hold several), with the update's DP-global normalisers (`normalisers`) and
    the phase (`clips(phase)`: PPO clip on fresh tokens);
  * `uses_pool` (False = on-policy: no pool; the pool's settings are the `experience` config group's) and
    `pool_outcome` (what the pool learns from one graded group);
  * `response_replay(experience)`: which of a fresh question's stored past responses its group gains (in-group
    and rescue replay, experience/response_store.py; None: the run keeps no response store);
  * `metric_reduce_op` / `step_metrics`: how its loss metrics combine and the step metrics it declares (only
    those its loss returns the terms of; algo/loss_metrics.py).

A variant is one file in algo/variants/ that registers its class under a name (`registry.register`) and is
selected with `algo.name=<name>`; a class outside the package is selected with `algo.name=package.module:Class`.
`from_config` reads the config values the variant uses. docs/algorithms.md walks through writing one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from torch import Tensor

from exgrpo_megatron.algo.policy_loss import LossBatch
from exgrpo_megatron.config.schema import AlgoConfig, ExperienceConfig, TrainerConfig
from exgrpo_megatron.experience.response_store import ResponseReplay
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.experience.types import GroupOutcome


@dataclass(frozen=True)
class GradedResponse:
    """One graded response of a group, as the pool hook sees it."""

    token_ids: np.ndarray  # int32 response tokens (including the final EOS)
    logprobs: np.ndarray  # float32 behaviour log-probs of those tokens
    reward: float


@runtime_checkable
class RLAlgorithm(Protocol):
    name: str
    entropy_coeff: float  # > 0: the loss needs differentiable entropies

    @property
    def filters_groups(self) -> bool:
        """Can `keep_group` drop a group? (False: the trainer skips the filter and its exchange over DP.)"""
        ...

    @property
    def uses_pool(self) -> bool:
        """Does it train with the experience pool (configured by the `experience` group, conf/experience/)?
        False: on-policy (no pool, the schedule stays in warm-up)."""
        ...

    @classmethod
    def from_config(cls, name: str, algo: AlgoConfig, trainer: TrainerConfig,
                    max_response_length: int) -> RLAlgorithm:
        """The algorithm with every config value it reads (the one place they are read)."""
        ...

    def advantages(self, rewards: Tensor) -> Tensor:
        """Per-sequence advantages of groups: rewards [G, K] float64 -> [G, K]."""
        ...

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """Does a graded group enter the training batch? (must depend on its rewards only: every DP rank
        decides the same for the same group)."""
        ...

    def clips(self, phase: Phase) -> bool:
        """Does `phase` keep the surrogate's trust region (PPO's clip) on fresh tokens?"""
        ...

    def normalisers(self, num_tokens_global: float, num_seqs_global: float) -> tuple[float, float]:
        """(pg, entropy) normalisers of one mini-batch from its DP-global counts (`loss.global_loss_counts`)."""
        ...

    def loss(self, batch: LossBatch, *, phase: Phase, normalisers: tuple[float, float]
             ) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's loss and its metrics (detached float64 scalars, reduced by `metric_reduce_op`)."""
        ...

    def pool_outcome(self, qid: int, responses: Sequence[GradedResponse], step: int,
                     collect: bool) -> GroupOutcome | None:
        """What the experience pool learns from one graded group (None: nothing)."""
        ...

    def response_replay(self, experience: ExperienceConfig) -> ResponseReplay | None:
        """Which stored responses of a fresh question its group gains, no generation (None: no response store)."""
        ...

    def metric_reduce_op(self, key: str) -> str:
        """How a loss metric combines over micro-batches and DP ranks: 'max' or 'sum'."""
        ...

    def step_metrics(self, reduced: dict[str, float]) -> dict[str, float]:
        """The step metrics it declares, from its loss metrics reduced over the step."""
        ...
