"""`algo.name=exgrpo`: ExGRPO (arXiv 2510.02245) -- GRPO with an experience pool whose replayed trajectories
train through policy shaping.

It owns what the paper defines and ablates: the denominator of the replay ratio (importance-sampling correction,
`algo.settings.replay_is_correction`), the loss of each phase (warm-up: PPO clip on fresh tokens; collecting / mixed:
unclipped, replayed tokens shaped by f(w) or, with `algo.settings.replay_tis_cap`, trained as fresh tokens weighted by
truncated IS: the replay term; algo/loss.py, assembled by `GroupRelative.loss_spec`) and what the pool learns from a
group (`pool_outcome`). These are ExGRPO's own settings, `algo.settings.<key>` (`ExGRPOSettings` below,
algo/settings.py), at the paper's values by default; their former flat names (`algo.shaping_beta`, ...) map to them
(config/aliases.py). The pool's own settings (rho, placement, delayed start, admission / retirement / age bounds,
selection) are the `experience` config group's.

The fresh tokens' ratio may be GSPO's sequence ratio (`algo.ratio=sequence`): a replayed trajectory is a whole
sequence of its own, so the sequence ratio of a fresh sequence never mixes in replayed tokens and the replay term is
unchanged. The surrogate is chosen by name (`algo.surrogate`: `ppo_clip`, `cispo`; algo/surrogates.py); the
truncated-IS replay term applies the same surrogate to replayed tokens.

It scales the entropy bonus to the original code's micro-batches (`algo.entropy_microbatches_ref`, algo/loss.py;
GRPO, the paper's baseline, does too); its settings are refused to every other variant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar

from torch import Tensor

from exgrpo_megatron.algo.group_relative import GroupRelative
from exgrpo_megatron.algo.loss import select_replay_denominator_logprobs
from exgrpo_megatron.algo.policy_loss import ReplayTerm, ShapedReplay, TruncatedISReplay
from exgrpo_megatron.algo.protocol import GradedResponse
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.settings import VariantSettings, read_settings
from exgrpo_megatron.algo.surrogates import Surrogate, surrogate_class
from exgrpo_megatron.config.domains import NON_NEGATIVE, POSITIVE, Domain
from exgrpo_megatron.config.schema import AlgoConfig, TrainerConfig
from exgrpo_megatron.config.validate import ConfigError
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.experience.types import GroupOutcome


@dataclass(frozen=True)
class ExGRPOSettings(VariantSettings):
    """`algo.settings.*` of ExGRPO: the replay term and the phases' clip (the paper's values by default)."""

    shaping_beta: float = 0.1  # f(w) = w / (w + beta) on replayed tokens (paper Eq. 6)
    policy_shaping: bool = True  # false: the plain unclipped IS ratio w on replayed tokens (paper Tab. 6 "w/o shaping")
    replay_is_correction: bool = True  # w against the recorded behaviour log-probs (false: this step's pi_old, w = 1)
    replay_tis_cap: float = 0.0  # > 0: replayed tokens as fresh ones x min(pi_old / pi_past, cap), no shaping
    mixed_phase_clip: bool = False  # PPO's clip on fresh tokens in the mixed phase too (paper §D.1: off)
    domains: ClassVar[Mapping[str, Domain]] = {"shaping_beta": POSITIVE, "replay_tis_cap": NON_NEGATIVE}

    def config_errors(self) -> list[str]:
        if self.replay_tis_cap > 0 and self.policy_shaping:
            return [f"algo.settings.replay_tis_cap: {self.replay_tis_cap}: replayed tokens corrected by truncated IS "
                    "take no policy shaping; set algo.settings.policy_shaping=false with it"]
        return []


@register("exgrpo")
@dataclass(frozen=True)
class ExGRPO(GroupRelative):
    shaping_beta: float
    policy_shaping: bool
    mixed_phase_clip: bool
    replay_is_correction: bool
    replay_tis_cap: float  # > 0: replayed tokens as fresh ones x min(pi_old / pi_past, cap), no shaping
    settings_class: ClassVar[type[ExGRPOSettings]] = ExGRPOSettings
    algo_keys: ClassVar[frozenset[str]] = GroupRelative.algo_keys | {"surrogate"}
    entropy_reference: ClassVar[bool] = True  # its bonus at the original code's scale (algo/loss.py)

    @classmethod
    def surrogate_class(cls, algo: AlgoConfig) -> type[Surrogate]:
        """The surrogate `algo.surrogate` names (fresh tokens and the truncated-IS replay term)."""
        try:
            return surrogate_class(algo.surrogate)
        except ValueError as exc:
            raise ConfigError([f"algo.surrogate: {exc}"]) from None

    @classmethod
    def from_config(cls, name: str, algo: AlgoConfig, trainer: TrainerConfig, max_response_length: int) -> ExGRPO:
        return cls(**cls.shared_settings(name, algo, max_response_length),
                   **asdict(read_settings(ExGRPOSettings, algo)))

    @property
    def uses_pool(self) -> bool:
        return True

    def clips(self, phase: Phase) -> bool:
        """The trust region (PPO's clip) on fresh tokens: in warm-up only (paper §D.1: the mixed phase is unclipped),
        unless `algo.settings.mixed_phase_clip` keeps it in every phase."""
        return phase is Phase.WARMUP or self.mixed_phase_clip

    @property
    def replay_term(self) -> ReplayTerm:
        """-A * f(w) on replayed tokens, f(w) = w / (w + `algo.settings.shaping_beta`), the plain w without
        `algo.settings.policy_shaping`; with `algo.settings.replay_tis_cap` > 0 the fresh-token loss (the surrogate)
        x min(pi_old / pi_past, cap)."""
        if self.replay_tis_cap > 0:
            return TruncatedISReplay(self.replay_tis_cap)
        return ShapedReplay(self.shaping_beta, self.policy_shaping)

    def replay_denominator_logprobs(self, old_logprobs: Tensor, behaviour_logprobs: Tensor, replay: Tensor) -> Tensor:
        """The replay ratio's denominator: recorded pi_past on replayed tokens with IS correction, else pi_old."""
        return select_replay_denominator_logprobs(old_logprobs, behaviour_logprobs, replay, self.replay_is_correction)

    def pool_outcome(self, qid: int, responses: Sequence[GradedResponse], step: int,
                     collect: bool) -> GroupOutcome | None:
        """k correct of K, with the correct trajectories only once the schedule collects (the original collects
        nothing during warm-up); the pool retires (experience.retire_correct_above) in every phase."""
        k = int(sum(r.reward == 1.0 for r in responses))
        correct = [r for r in responses if r.reward == 1.0] if collect else []
        return GroupOutcome(qid=qid, k_correct=k, group_size=len(responses), step=step,
                            correct_token_ids=[r.token_ids for r in correct],
                            correct_logprobs=[r.logprobs for r in correct])
