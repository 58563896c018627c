"""The step metrics a loss declares, and how they come from its metrics reduced over a step.

A loss returns summable metrics (`policy_loss`: counts and sums, `_max` keys maxed); each part of its `LossSpec`
declares the step metrics it feeds and what they mean (`declared_metrics`: the policy terms, the surrogate's own,
algo/surrogates.py, and the replay term's), so the step summary looks up only what the loss returns: a loss without
a replay term declares no replay metric, and a surrogate's metric carries its own name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class StepMetric:
    """A logged step metric: the reduced loss metric `total`, divided by `per` when given (0 when `per` is 0);
    `meaning`: what it measures."""

    name: str
    total: str
    per: str | None = None
    meaning: str = ""

    def value(self, reduced: Mapping[str, float]) -> float:
        if self.per is None:
            return reduced[self.total]
        return reduced[self.total] / reduced[self.per] if reduced[self.per] > 0 else 0.0


POLICY_METRICS = (
    StepMetric("loss/policy", "pg_loss", None, "the aggregated policy-gradient loss summed over the step's updates"),
    StepMetric("loss/entropy_bonus", "entropy_bonus", None, "the entropy bonus subtracted from the loss"),
    StepMetric("entropy/mean", "entropy_sum", "token_count", "token mean of the policy's entropy"),
    StepMetric("loss/approx_kl", "approx_kl_sum", "fresh_token_count",
               "k3 estimate of KL(pi_old || pi_theta) over fresh tokens"),
    StepMetric("rollout/is_weight_mean", "fresh_is_weight_sum", "fresh_token_count",
               "mean truncated IS weight min(pi_old / pi_engine, algo.fresh_is_cap) of fresh tokens (0: off)"),
    StepMetric("rollout/is_truncated_fraction", "fresh_is_truncated_count", "fresh_token_count",
               "fraction of fresh tokens whose IS weight the cap bound"),
)
REPLAY_METRICS = (
    StepMetric("replay/is_weight_mean", "replay_weight_sum", "replay_token_count",
               "mean ratio w = pi_theta / the replay denominator over replayed tokens"),
    StepMetric("replay/is_weight_max", "replay_weight_max", None, "largest w of a replayed token"),
    StepMetric("replay/shaped_weight_mean", "replay_shaped_weight_sum", "replay_token_count",
               "mean weight the replay term multiplies A by: f(w), w, or the truncated-IS u x rho"),
    StepMetric("replay/token_fraction", "replay_token_count", "token_count", "fraction of tokens that are replayed"),
)


def declared_metrics(surrogate_metrics: tuple[StepMetric, ...], has_replay_term: bool) -> tuple[StepMetric, ...]:
    """The step metrics of a `policy_loss` with this surrogate's metrics, with (or without) a replay term."""
    return POLICY_METRICS + surrogate_metrics + (REPLAY_METRICS if has_replay_term else ())


def metric_reduce_op(key: str) -> str:
    """'max' for keys ending in `_max`, else 'sum' (how `policy_loss` metrics combine)."""
    return "max" if key.endswith("_max") else "sum"


def summarize_loss_metrics(declared: tuple[StepMetric, ...], reduced: Mapping[str, float | Tensor]
                           ) -> dict[str, float]:
    """The declared step metrics from loss metrics reduced over micro-batches and DP ranks; all 0.0 when no update
    ran a loss (no `pg_loss`). A declared metric the loss did not return is a KeyError naming it."""
    if "pg_loss" not in reduced:
        return {m.name: 0.0 for m in declared}
    values = {k: float(x) for k, x in reduced.items()}
    return {m.name: m.value(values) for m in declared}
