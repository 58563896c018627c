"""What the group-relative policy-gradient variants share (GRPO, ExGRPO and those built on them): their common
settings (read from the config in one place, `shared_settings`), group-mean advantages, keep-every-group, the loss
normalisers, the loss assembled from its parts (`loss_spec`: ratio, surrogate, trust region, aggregation, replay
term; algo/policy_loss.py), the truncated importance weights of fresh tokens and the step metrics the loss declares.
A variant adds its own fields and overrides what it changes (algo/variants/).

Each variant declares the algo.* keys it reads (`algo_keys`, with its surrogate's: `algo_keys_read`), the keys it
fixes and why (`fixed_algo_keys`: the run says so at start-up when the config asks for another value) and the keys
it leaves unused on purpose (`unused_algo_keys`: warned when set); any other algo.* key set to a value other than its
default is refused at start-up, naming it (config/validate.py `algo_key_errors`, called by `registry.build_algorithm`).
Its own knobs, which no other variant reads, are its settings (`settings_class`, `algo.settings.<key>`;
algo/settings.py), declared and defaulted in its file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from exgrpo_megatron.algo.advantages import group_advantages
from exgrpo_megatron.algo.loss import TruncatedIS, loss_normalisers, truncated_is_weight
from exgrpo_megatron.algo.loss_metrics import StepMetric, declared_metrics, metric_reduce_op, summarize_loss_metrics
from exgrpo_megatron.algo.policy_loss import LossBatch, LossSpec, ReplayTerm, policy_loss
from exgrpo_megatron.algo.settings import settings_classes
from exgrpo_megatron.algo.surrogates import PPOClip, Surrogate
from exgrpo_megatron.config.schema import AlgoConfig, ExperienceConfig
from exgrpo_megatron.experience.response_store import ResponseReplay
from exgrpo_megatron.experience.schedule import Phase


@dataclass(frozen=True)
class GroupRelative:
    """The shared settings and methods; a variant is a frozen dataclass subclass adding its own fields."""

    name: str
    adv_std_normalize: bool
    ratio: str  # fresh tokens' importance ratio: token | sequence (GSPO)
    surrogate: Surrogate  # how a token's ratio and advantage become its loss (algo/surrogates.py; default PPO clip)
    entropy_coeff: float
    loss_agg_mode: str
    loss_seqs_per_rank_ref: float
    entropy_microbatches_ref: float  # the entropy bonus x this (1 unless the variant asks: `entropy_reference`)
    max_response_length: int
    fresh_is_cap: float  # > 0: fresh tokens' loss x min(pi_old / pi_engine, cap); 0: off
    filters_groups = False
    # Does the variant scale its entropy bonus to the original code's micro-batches (`algo.entropy_microbatches_ref`,
    # algo/loss.py)? Not inherited: a variant asks for it in its own class body (`__init_subclass__`), else its
    # bonus is entropy_coeff x the token mean of H and the key is unused.
    entropy_reference: ClassVar[bool] = False
    algo_keys: ClassVar[frozenset[str]] = frozenset({
        "adv_std_normalize", "ratio", "entropy_coeff", "loss_agg_mode", "loss_seqs_per_rank_ref", "fresh_is_cap"})
    fixed_algo_keys: ClassVar[Mapping[str, tuple[Any, str]]] = {}  # key: (the value it always takes, why)
    # the response store's experience.* keys it reads (config/validate.py RESPONSE_STORE_KEYS; others refuse them)
    experience_keys: ClassVar[frozenset[str]] = frozenset()
    unused_algo_keys: ClassVar[Mapping[str, str]] = {  # key: why it is not read (warned when set)
        "entropy_microbatches_ref": "its entropy bonus is entropy_coeff x the token mean of H (the variants that "
                                    "scale it to the original code's micro-batches: exgrpo, grpo)",
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "entropy_reference" not in cls.__dict__:
            cls.entropy_reference = False

    @classmethod
    def surrogate_class(cls, algo: AlgoConfig) -> type[Surrogate]:
        """The surrogate class this variant trains with (PPO's clip; a variant changes it by overriding this)."""
        return PPOClip

    @classmethod
    def algo_keys_read(cls, algo: AlgoConfig) -> frozenset[str]:
        """Every algo.* key `from_config` reads: the variant's, its surrogate's, `algo.settings` when either has
        settings of its own (algo/settings.py), and
        `algo.max_refill_rounds` when it filters groups (the trainer's refill, rollout/group_filter.py)."""
        keys = cls.algo_keys | cls.surrogate_class(algo).algo_keys
        keys |= {"entropy_microbatches_ref"} if cls.entropy_reference else set()
        classes = settings_classes(cls, algo)
        keys |= {"settings"} if classes else set()
        return keys | {"max_refill_rounds"} if cls.filters_groups else keys

    @classmethod
    def config_errors(cls, algo: AlgoConfig) -> list[str]:
        """The relations between the keys the variant reads (`key: reason` lines; none here)."""
        return []

    @classmethod
    def shared_settings(cls, name: str, algo: AlgoConfig, max_response_length: int) -> dict[str, Any]:
        """The shared fields' values (the one place they are read): a key in `algo_keys` from the config, a fixed one
        its fixed value, any other the schema's default (the variant does not use it)."""
        default = AlgoConfig()

        def value(key: str) -> Any:
            if key in cls.fixed_algo_keys:
                return cls.fixed_algo_keys[key][0]
            return getattr(algo if key in cls.algo_keys else default, key)

        keys = ("adv_std_normalize", "ratio", "entropy_coeff", "loss_agg_mode", "loss_seqs_per_rank_ref",
                "fresh_is_cap")
        entropy_ref = algo.entropy_microbatches_ref if cls.entropy_reference else 1.0
        return dict(name=name, surrogate=cls.surrogate_class(algo).from_config(algo),
                    entropy_microbatches_ref=entropy_ref, max_response_length=max_response_length,
                    **{key: value(key) for key in keys})

    def advantages(self, rewards: Tensor) -> Tensor:
        """A_i = r_i - mean_{j in G} r_j (Dr.GRPO), divided by the group std with `algo.adv_std_normalize`."""
        return group_advantages(rewards, std_normalize=self.adv_std_normalize)

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """Every group is trained on (no filter)."""
        return True

    def normalisers(self, num_tokens_global: float, num_seqs_global: float) -> tuple[float, float]:
        """(pg, entropy) normalisers (`loss.loss_normalisers`); the entropy bonus x `entropy_microbatches_ref`."""
        return loss_normalisers(num_tokens_global, num_seqs_global, self.loss_agg_mode, self.max_response_length,
                                self.loss_seqs_per_rank_ref, self.entropy_microbatches_ref)

    def clips(self, phase: Phase) -> bool:
        """Does `phase` keep the surrogate's trust region (PPO's clip) on fresh tokens? (on-policy variants: always)"""
        return True

    @property
    def replay_term(self) -> ReplayTerm | None:
        """The replay term; None: a loss without one (on-policy: a replayed row is an error, no replay metrics)."""
        return None

    def response_replay(self, experience: ExperienceConfig) -> ResponseReplay | None:
        """Which stored responses a fresh group gains from the response store (None: no store, nothing gained)."""
        return None

    def replay_denominator_logprobs(self, old_logprobs: Tensor, behaviour_logprobs: Tensor, replay: Tensor) -> Tensor:
        """The replay ratio's denominator (on-policy variants: pi_old)."""
        return old_logprobs

    def loss_spec(self, phase: Phase) -> LossSpec:
        """The parts of the loss in `phase`."""
        return LossSpec(ratio=self.ratio, surrogate=self.surrogate, trust_region=self.clips(phase),
                        aggregation=self.loss_agg_mode, replay=self.replay_term, entropy_coeff=self.entropy_coeff)

    def loss(self, batch: LossBatch, *, phase: Phase, normalisers: tuple[float, float]
             ) -> tuple[Tensor, dict[str, Tensor]]:
        """`policy_loss` of `loss_spec(phase)`; fresh tokens weighted by truncated IS against the engine's log-probs
        with `algo.fresh_is_cap` > 0."""
        spec = self.loss_spec(phase)
        denominator = None if spec.replay is None else self.replay_denominator_logprobs(
            batch.old_logprobs, batch.behaviour_logprobs, batch.replay)
        return policy_loss(batch, spec, normalisers, replay_denominator=denominator,
                           fresh_is=self.fresh_is_weights(batch.old_logprobs, batch.behaviour_logprobs, batch.replay))

    def fresh_is_weights(self, old_logprobs: Tensor, behaviour_logprobs: Tensor, replay: Tensor
                         ) -> TruncatedIS | None:
        """Truncated IS weights of fresh tokens, min(exp(logp_old - logp_behaviour), fresh_is_cap)
        (`loss.truncated_is_weight`); None when the cap is 0. `replay` ([B] or [B, T]) marks the rows whose
        `behaviour_logprobs` are a replayed trajectory's recorded ones, not the engine's: their weight is 1 (the loss
        applies the weight to fresh tokens only)."""
        if self.fresh_is_cap <= 0:
            return None
        rep = replay if replay.dim() == old_logprobs.dim() else replay.unsqueeze(-1).expand_as(old_logprobs)
        fresh_behaviour = torch.where(rep.bool(), old_logprobs, behaviour_logprobs)
        return truncated_is_weight(old_logprobs, fresh_behaviour, self.fresh_is_cap)

    def metric_reduce_op(self, key: str) -> str:
        return metric_reduce_op(key)

    @property
    def declared_metrics(self) -> tuple[StepMetric, ...]:
        """The step metrics its loss returns the terms of."""
        return declared_metrics(self.surrogate.metrics, self.replay_term is not None)

    def step_metrics(self, reduced: dict[str, float]) -> dict[str, float]:
        """The declared metrics from the loss metrics reduced over the step (0.0 when no update ran a loss)."""
        return summarize_loss_metrics(self.declared_metrics, reduced)
