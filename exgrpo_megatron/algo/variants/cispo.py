"""`algo.name=cispo`: CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4-5): on-policy GRPO whose surrogate clips the importance
weight, not the update. Per token, with r = pi_theta / pi_old and sg the stop-gradient,

    l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(o_t),

aggregated over all tokens of the batch (token mean): every token keeps a gradient, the weight only bounds how much.
The paper sets no lower bound (eps_low large): `algo.settings.cispo_eps_low=null`, the default; it tunes eps_high,
`algo.settings.cispo_eps_high`. Both are CISPO's own settings (`CISPOSettings` below, algo/settings.py).

The surrogate (`CISPOWeight`, registered as `cispo`) computes the per-token loss as
-sg(w) * A * (1 + log r - sg(log r)): the same gradient, -w A grad log pi_theta, with the value -w A (PPO's -A rho
at w = rho), so `loss/policy` stays on the scale of the other surrogates. Its metric is
`loss/cispo_weight_clip_fraction` (the tokens whose weight a bound caps; their gradient is kept), not PPO's
`loss/clip_fraction` (the tokens whose gradient the clip drops). Its bound applies in every phase: it is the
estimator's, not a trust region. ExGRPO trains with it too (`algo.name=exgrpo algo.surrogate=cispo`), on fresh
tokens and in the truncated-IS replay term.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from exgrpo_megatron.algo.loss_metrics import StepMetric
from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.settings import VariantSettings, read_settings
from exgrpo_megatron.algo.surrogates import Surrogate, SurrogateInputs, SurrogateLoss, register_surrogate
from exgrpo_megatron.algo.variants.grpo import GRPO
from exgrpo_megatron.config.domains import POSITIVE, Domain
from exgrpo_megatron.config.schema import AlgoConfig


@dataclass(frozen=True)
class CISPOSettings(VariantSettings):
    """`algo.settings.*` of the cispo surrogate (algo.name=cispo, or exgrpo with algo.surrogate=cispo)."""

    cispo_eps_low: float | None = None  # IS weight >= 1 - this; None = no lower bound (MiniMax-M1's choice)
    cispo_eps_high: float = 0.28  # IS weight <= 1 + this (the paper tunes it, giving no value; DAPO's clip-higher)
    domains: ClassVar[Mapping[str, Domain]] = {
        "cispo_eps_low": Domain(lo=0, none_ok=True),  # >= 1 bounds nothing either
        "cispo_eps_high": POSITIVE,
    }


@register_surrogate("cispo")
@dataclass(frozen=True)
class CISPOWeight:
    """-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta per token; eps_low None: no lower bound."""

    eps_low: float | None
    eps_high: float
    algo_keys: ClassVar[frozenset[str]] = frozenset()
    settings_class: ClassVar[type[CISPOSettings]] = CISPOSettings
    metrics: ClassVar[tuple[StepMetric, ...]] = (
        StepMetric("loss/cispo_weight_clip_fraction", "cispo_weight_clipped_count", "fresh_token_count",
                   "fraction of fresh tokens whose IS weight r a CISPO bound caps (their gradient is kept, "
                   "weighted by the bound)"),
    )

    @classmethod
    def from_config(cls, algo: AlgoConfig) -> CISPOWeight:
        settings = read_settings(CISPOSettings, algo)
        return cls(settings.cispo_eps_low, settings.cispo_eps_high)

    def token_loss(self, inputs: SurrogateInputs, trust_region: bool) -> SurrogateLoss:
        log_r = inputs.log_ratio
        ratio = torch.exp(log_r.detach())
        low = None if self.eps_low is None else 1.0 - self.eps_low
        weight = torch.clamp(ratio, min=low, max=1.0 + self.eps_high)
        loss = -weight * inputs.advantages * (1.0 + log_r - log_r.detach())
        return SurrogateLoss(loss, {"cispo_weight_clipped_count": weight != ratio})


@register("cispo")
@dataclass(frozen=True)
class CISPO(GRPO):
    algo_keys: ClassVar[frozenset[str]] = GRPO.algo_keys - {"loss_agg_mode"}
    fixed_algo_keys: ClassVar[Mapping[str, tuple[Any, str]]] = {
        "loss_agg_mode": ("token_mean", "CISPO normalises by the batch's token count (MiniMax-M1 Eq. 4)"),
    }

    @classmethod
    def surrogate_class(cls, algo: AlgoConfig) -> type[Surrogate]:
        return CISPOWeight
