"""`algo.name=ingroup_replay`: in-group replay (RePO, "Replay-Enhanced Policy Optimization", Li et al. 2025): on-policy
GRPO whose every fresh question's group of K rollouts gains up to r = `experience.ingroup_size` of that question's
own stored past responses (the newest first; successes and, with `experience.ingroup_failures`, failures), from the
response store (experience/response_store.py). Nothing is generated for them.

  * advantages over the enlarged group: the K fresh and the r_q stored rewards (r_q <= r: what the store holds for
    q; it differs per question and per rank) form one group of K + r_q (`GroupRelative.advantages`);
  * a replayed token trains with the fresh tokens' loss -- the surrogate of the ratio against pi_old, PPO's clip --
    times u = min(pi_old / pi_recorded, C) against its RECORDED behaviour log-probs, detached: the truncated-IS
    replay term (`TruncatedISReplay`, algo/policy_loss.py) with C = `algo.settings.replay_tis_cap`;
  * stored responses older than `experience.max_age_steps` steps are dropped (0: kept until evicted by newer ones).

C is this variant's own setting (`ResponseReplaySettings` below), 2 by default: a replayed response always needs the
correction (it was sampled by an older policy), and a cap of 2 lets a response the policy now likes more weigh up to
twice, no more, bounding the variance as in the ExGRPO authors' port (conf/exgrpo_su01.yaml) and slime's truncated IS
(ExGRPO's setting of the same name is 0, off, by default: there it switches f(w) for this term). The store keeps the
newest r responses of each question (the current step's K replace older ones). A run can start from another run's
store (`experience.pool_file_in`, RLEP; checkpoint/pool_file.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from exgrpo_megatron.algo.loss import select_replay_denominator_logprobs
from exgrpo_megatron.algo.policy_loss import ReplayTerm, TruncatedISReplay
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.settings import VariantSettings, read_settings
from exgrpo_megatron.algo.variants.grpo import GRPO
from exgrpo_megatron.config.domains import POSITIVE, Domain
from exgrpo_megatron.config.schema import AlgoConfig, ExperienceConfig, TrainerConfig
from exgrpo_megatron.experience.response_store import ResponseReplay


@dataclass(frozen=True)
class ResponseReplaySettings(VariantSettings):
    """`algo.settings.*` of the response-replay variants (ingroup_replay, rescue_replay)."""

    replay_tis_cap: float = 2.0  # C of min(pi_old / pi_recorded, C) on replayed tokens (module docstring)
    domains: ClassVar[Mapping[str, Domain]] = {"replay_tis_cap": POSITIVE}


@register("ingroup_replay")
@dataclass(frozen=True)
class InGroupReplay(GRPO):
    replay_tis_cap: float  # C of min(pi_old / pi_recorded, C) on replayed tokens (> 0)
    settings_class: ClassVar[type[ResponseReplaySettings]] = ResponseReplaySettings
    experience_keys: ClassVar[frozenset[str]] = frozenset({
        "ingroup_size", "ingroup_failures", "max_age_steps", "pool_file_in", "pool_file_out"})
    entropy_reference: ClassVar[bool] = True  # compared with GRPO at its entropy scale

    @classmethod
    def from_config(cls, name: str, algo: AlgoConfig, trainer: TrainerConfig,
                    max_response_length: int) -> InGroupReplay:
        return cls(**cls.shared_settings(name, algo, max_response_length),
                   replay_tis_cap=read_settings(ResponseReplaySettings, algo).replay_tis_cap)

    def response_replay(self, experience: ExperienceConfig) -> ResponseReplay | None:
        """Up to `experience.ingroup_size` stored responses per fresh group, failures with `ingroup_failures`."""
        return ResponseReplay(experience.ingroup_size, experience.ingroup_failures)

    @property
    def replay_term(self) -> ReplayTerm:
        return TruncatedISReplay(self.replay_tis_cap)

    def replay_denominator_logprobs(self, old_logprobs: Tensor, behaviour_logprobs: Tensor, replay: Tensor) -> Tensor:
        """The recorded behaviour log-probs on replayed tokens (the truncated IS weight's denominator)."""
        return select_replay_denominator_logprobs(old_logprobs, behaviour_logprobs, replay, True)
