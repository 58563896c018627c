"""The surrogate part of a loss: how a token's importance ratio and advantage become its loss, chosen by name.

A surrogate takes, per token, the ratio part's log rho (`loss.log_ratio`: the token ratio, or GSPO's sequence ratio
in its token form), the plain token log ratio and the advantage, and returns the token's loss under the phase's
trust region (`trust_region`: False where the variant lifts PPO's clip, ExGRPO's mixed phase) and the per-token
terms of the step metrics it declares (`metrics`: each with what it means). The fresh tokens' loss and the
truncated-IS replay term (`TruncatedISReplay`, algo/policy_loss.py) both apply the spec's surrogate, so a variant
that changes the surrogate changes it for every token it trains.

Registered by name (`register_surrogate`, `surrogate_class`): `ppo_clip` here; a variant's file registers its own
(algo/variants/cispo.py: `cispo`). Each surrogate class declares the algo.* keys it reads (`algo_keys`) and reads
them in `from_config`; knobs of its own are its settings (`settings_class`, `algo.settings.<key>`, algo/settings.py),
declared in its file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol, TypeVar, cast

from torch import Tensor

from exgrpo_megatron.algo.loss import Clip, clipped_surrogate
from exgrpo_megatron.algo.loss_metrics import StepMetric
from exgrpo_megatron.config.schema import AlgoConfig


class SurrogateInputs(NamedTuple):
    """What a surrogate reads, per token [B, T] (0 off the tokens it is applied to)."""

    log_ratio: Tensor  # the ratio part's log rho against pi_old (token, or GSPO's sequence form), differentiable
    token_log_ratio: Tensor  # log pi_theta - log pi_old of the token itself, differentiable
    advantages: Tensor


class SurrogateLoss(NamedTuple):
    """A surrogate's per-token loss and the per-token terms of its declared metrics (summed over fresh tokens)."""

    loss: Tensor
    terms: dict[str, Tensor]


class Surrogate(Protocol):
    algo_keys: ClassVar[frozenset[str]]  # the algo.* keys `from_config` reads
    metrics: ClassVar[tuple[StepMetric, ...]]  # the step metrics its `terms` feed, and what they mean

    @classmethod
    def from_config(cls, algo: AlgoConfig) -> Surrogate:
        ...

    def token_loss(self, inputs: SurrogateInputs, trust_region: bool) -> SurrogateLoss:
        ...


_SURROGATES: dict[str, type[Surrogate]] = {}
S = TypeVar("S", bound=type)


def register_surrogate(name: str) -> Callable[[S], S]:
    """Class decorator: the surrogate a variant selects by `name` (ExGRPO: `algo.surrogate=<name>`)."""
    def add(cls: S) -> S:
        if _SURROGATES.get(name, cls) is not cls:
            raise ValueError(f"surrogate name {name!r} is registered twice")
        _SURROGATES[name] = cast(type[Surrogate], cls)
        return cls
    return add


def surrogate_names() -> list[str]:
    """Every registered surrogate's name (the variants' files imported first)."""
    from exgrpo_megatron.algo import variants

    variants.import_all()
    return sorted(_SURROGATES)


def surrogate_class(name: str) -> type[Surrogate]:
    """The surrogate registered as `name` (the variants' files are imported first: they may register one);
    ValueError naming the registered ones otherwise."""
    from exgrpo_megatron.algo import variants

    variants.import_all()
    if name not in _SURROGATES:
        raise ValueError(f"expected one of {sorted(_SURROGATES)}, got {name!r}")
    return _SURROGATES[name]


@register_surrogate("ppo_clip")
@dataclass(frozen=True)
class PPOClip:
    """PPO's clipped surrogate (`loss.clipped_surrogate`): l = max(-A rho, -A clip(rho, 1 - low, 1 + high)) inside
    the trust region, -A rho outside it. low == high is PPO's clip; high > low DAPO's clip-higher."""

    clip: Clip
    algo_keys: ClassVar[frozenset[str]] = frozenset({"clip_ratio", "clip_ratio_high"})
    metrics: ClassVar[tuple[StepMetric, ...]] = (
        StepMetric("loss/clip_fraction", "clipped_token_count", "fresh_token_count",
                   "fraction of fresh tokens on PPO's clipped branch (the clip binds: no gradient; 0 outside the "
                   "trust region)"),
    )

    @classmethod
    def from_config(cls, algo: AlgoConfig) -> PPOClip:
        high = algo.clip_ratio if algo.clip_ratio_high is None else algo.clip_ratio_high
        return cls(Clip(algo.clip_ratio, high))

    def token_loss(self, inputs: SurrogateInputs, trust_region: bool) -> SurrogateLoss:
        loss, clipped = clipped_surrogate(inputs.log_ratio, inputs.advantages, self.clip if trust_region else None)
        return SurrogateLoss(loss, {"clipped_token_count": clipped})
