"""`algo.name=grpo_kl`: GRPO with the KL penalty of the GRPO paper (Shao et al. 2024, DeepSeekMath, Eq. 3-4): per token
the PPO-clipped surrogate plus beta x the k3 estimate of KL(pi_theta || pi_ref),

    l = max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) + beta * (pi_ref / pi_theta - log(pi_ref / pi_theta) - 1),

with pi_ref = pi_old: this code keeps no reference model (the initial policy), so the penalty holds each update near
the policy that generated the step (0 and without gradient at the step's first update, where pi_theta = pi_old).
beta = `algo.settings.kl_coef` (`KLSettings` below; the paper: 0.04). The surrogate (`PPOClipKL`, registered as
`ppo_clip_kl`) logs the penalty's token mean as `loss/kl_penalty`; ExGRPO trains with it too (`algo.name=exgrpo
algo.surrogate=ppo_clip_kl`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from exgrpo_megatron.algo.loss_metrics import StepMetric
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.settings import VariantSettings, read_settings
from exgrpo_megatron.algo.surrogates import PPOClip, Surrogate, SurrogateInputs, SurrogateLoss, register_surrogate
from exgrpo_megatron.algo.variants.grpo import GRPO
from exgrpo_megatron.config.domains import NON_NEGATIVE, Domain
from exgrpo_megatron.config.schema import AlgoConfig


@dataclass(frozen=True)
class KLSettings(VariantSettings):
    """`algo.settings.*` of the ppo_clip_kl surrogate (algo.name=grpo_kl, or exgrpo with algo.surrogate=ppo_clip_kl)."""

    kl_coef: float = 0.04  # beta of the k3 KL(pi_theta || pi_old) penalty per token (DeepSeekMath: 0.04, against
    # its reference model)
    domains: ClassVar[Mapping[str, Domain]] = {"kl_coef": NON_NEGATIVE}


@register_surrogate("ppo_clip_kl")
@dataclass(frozen=True)
class PPOClipKL:
    """PPO's clipped surrogate + kl_coef x k3(pi_old / pi_theta) per token."""

    ppo: PPOClip
    kl_coef: float
    algo_keys: ClassVar[frozenset[str]] = PPOClip.algo_keys
    settings_class: ClassVar[type[KLSettings]] = KLSettings
    metrics: ClassVar[tuple[StepMetric, ...]] = PPOClip.metrics + (
        StepMetric("loss/kl_penalty", "kl_penalty_sum", "fresh_token_count",
                   "token mean of the k3 estimate of KL(pi_theta || pi_old) the loss adds, before x kl_coef"),
    )

    @classmethod
    def from_config(cls, algo: AlgoConfig) -> PPOClipKL:
        return cls(PPOClip.from_config(algo), read_settings(KLSettings, algo).kl_coef)

    def token_loss(self, inputs: SurrogateInputs, trust_region: bool) -> SurrogateLoss:
        clipped = self.ppo.token_loss(inputs, trust_region)
        log_ref_over_theta = -inputs.token_log_ratio
        k3 = torch.expm1(log_ref_over_theta) - log_ref_over_theta
        return SurrogateLoss(clipped.loss + self.kl_coef * k3, {**clipped.terms, "kl_penalty_sum": k3.detach()})


@register("grpo_kl")
@dataclass(frozen=True)
class GRPOKL(GRPO):
    @classmethod
    def surrogate_class(cls, algo: AlgoConfig) -> type[Surrogate]:
        return PPOClipKL
