"""Per-step metrics: each verb of the step returns what it measured on this rank (`rollout_sums`, the
mismatch, `UpdateMetrics`; together `TrainMetrics`), and `dp_reduce` reduces their totals over the data-parallel
ranks once (each DP rank saw a share of the groups). The step's one clock: `StepTimer`.

Metrics only report: nothing here steers the run (the phase is `experience.schedule`'s, fed by
`schedule.solved_fraction`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from exgrpo_megatron.algo.loss import mult_prob_error_sums
from exgrpo_megatron.policy.policy import UpdateResult
from exgrpo_megatron.policy.train_batch import RolloutRows, TrainBatch
from exgrpo_megatron.rollout.types import Sample


def rollout_mismatch(batch: TrainBatch) -> tuple[float, float]:
    """(sum, count) of exp(|logp_behaviour - logp_trainer|) over fresh response tokens, pi_old recomputed by the
    trainer: 1.0 when the rollout engine and the trainer agree (`algo.loss.mult_prob_error_sums`)."""
    if batch.old_logprobs is None:
        raise ValueError("rollout_mismatch: pi_old was not recomputed (the first update's forward measures it)")
    total, count = 0.0, 0.0
    for behaviour, old, rep in zip(batch.behaviour_logprobs, batch.old_logprobs, batch.is_replay, strict=True):
        if rep or behaviour.numel() == 0:
            continue
        row_sum, row_count = mult_prob_error_sums(behaviour, old, torch.ones_like(behaviour, dtype=torch.bool))
        total += float(row_sum)
        count += float(row_count)
    return total, count


def pop_mismatch(per_micro: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(sum, count) of the loss's mismatch metrics (`policy.objective.rl_loss_fn` with measure_mismatch), removed
    from the micro-batch metrics; (0, 0) when the loss did not measure it."""
    total, count = 0.0, 0.0
    for m in per_micro:
        total += float(m.pop("mismatch_sum", 0.0))
        count += float(m.pop("mismatch_count", 0.0))
    return total, count


class StepTimer:
    """The step's one clock: `lap(name)` adds the seconds since the previous lap (or the start) to `name`."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start


def consecutive_skips_after(before: int, skipped: list[bool]) -> int:
    """The count of consecutive skipped updates after this step's updates (`skipped`, in order)."""
    for s in skipped:
        before = before + 1 if s else 0
    return before


def rollout_sums(rows: RolloutRows) -> dict[str, float]:
    """Reward / length / token sums and counts of this rank's rows (the step's means divide their DP sums)."""
    fresh = [r for r, rep in zip(rows.rewards, rows.is_replay, strict=True) if not rep]
    replay = [r for r, rep in zip(rows.rewards, rows.is_replay, strict=True) if rep]
    return {"reward_sum": float(sum(rows.rewards)), "reward_n": float(len(rows.rewards)),
            "fresh_sum": float(sum(fresh)), "fresh_n": float(len(fresh)), "replay_sum": float(sum(replay)),
            "replay_n": float(len(replay)), "length_sum": float(sum(rows.response_lengths)),
            "tokens": float(sum(len(s) for s in rows.sequences))}


def generation_sums(graded_samples: list[list[Sample]]) -> dict[str, float]:
    """The trajectories and response tokens this rank's engine generated this step: every graded group's samples
    (refill rounds and groups the filter dropped included) except the stored trajectories spliced into replayed
    groups. The step's compute in generation, to compare recipes at equal generation (`generation/*`)."""
    generated = [s for group in graded_samples for s in group if not s.is_replay]
    return {"generated_trajectories": float(len(generated)),
            "generated_tokens": float(sum(len(s.response_ids) for s in generated))}


@dataclass(frozen=True)
class UpdateMetrics:
    """One mini-batch update on this rank: the optimizer step's result, each micro-batch's loss metrics in the
    order they ran (kept per micro-batch so that the step's sums are one running sum, as floats round), and the
    (sum, count) of the engine-vs-trainer mismatch its loss measured ((0, 0) when it did not: `pop_mismatch`)."""

    result: UpdateResult
    loss_metrics: tuple[dict[str, float], ...]
    mismatch: tuple[float, float]


@dataclass(frozen=True)
class TrainMetrics:
    """What training on this rank's rows measured (`trainer.train_on`): the rows' `rollout_sums`, the mismatch
    against a recomputed pi_old ((0, 0) when pi_old came from the rollout), the updates in order, and the rows
    whose pi_old needed a forward pass."""

    rollouts: dict[str, float]
    recomputed_mismatch: tuple[float, float]
    updates: tuple[UpdateMetrics, ...]
    forward_rows: int


@dataclass(frozen=True)
class Totals:
    """The step's totals: `sums` and `loss_sums` combine over DP ranks by SUM, `loss_maxes` by MAX
    (the algorithm's `metric_reduce_op`)."""

    sums: dict[str, float]
    loss_sums: dict[str, float]
    loss_maxes: dict[str, float]


def local_totals(trained: TrainMetrics, grader_deaths: int, reduce_op: Callable[[str], str]) -> Totals:
    """This rank's totals, folded in the order they were measured: the rows, the grader's worker deaths, the
    mismatch (recomputed pi_old, then each update's loss), the forward rows; the loss metrics of every
    micro-batch of every update (max-reduced keys start from 0)."""
    sums: dict[str, float] = {}

    def add(part: dict[str, float]) -> None:
        for k, v in part.items():
            sums[k] = sums.get(k, 0.0) + v

    add(trained.rollouts)
    add({"grader_deaths": float(grader_deaths)})
    for total, count in (trained.recomputed_mismatch, *(u.mismatch for u in trained.updates)):
        add({"mismatch_sum": total, "mismatch_n": count})
    add({"forward_rows": float(trained.forward_rows)})
    loss_sums: dict[str, float] = {}
    loss_maxes: dict[str, float] = {}
    for m in (m for u in trained.updates for m in u.loss_metrics):
        for k, v in m.items():
            if reduce_op(k) == "max":
                loss_maxes[k] = max(loss_maxes.get(k, 0.0), v)
            else:
                loss_sums[k] = loss_sums.get(k, 0.0) + v
    return Totals(sums, loss_sums, loss_maxes)


def dp_reduce(local: Totals, dp_group: Any) -> Totals:
    """The step's one reduction over the data-parallel (gloo) group: one SUM of the sums and loss sums, one MAX of
    the loss maxes; `dp_group` None: one DP rank, nothing to reduce."""
    if dp_group is None:
        return local
    skeys, lkeys, mkeys = sorted(local.sums), sorted(local.loss_sums), sorted(local.loss_maxes)
    sums = torch.tensor([local.sums[k] for k in skeys] + [local.loss_sums[k] for k in lkeys], dtype=torch.float64)
    maxes = torch.tensor([local.loss_maxes[k] for k in mkeys] or [0.0], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=dp_group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=dp_group)
    s = sums.tolist()
    return Totals(dict(zip(skeys, s[:len(skeys)], strict=True)), dict(zip(lkeys, s[len(skeys):], strict=True)),
                  dict(zip(mkeys, maxes.tolist(), strict=False)))


def step_summary(reduced: Totals, updates: tuple[UpdateMetrics, ...],
                 loss_metrics: Callable[[dict[str, float]], dict[str, float]]) -> dict[str, float]:
    """The step's metrics from its DP-reduced totals; `loss_metrics` maps the reduced loss metrics to the
    algorithm's declared ones. grad_norm / lr / skipped updates: the optimizer's, identical on every rank."""
    s = reduced.sums

    def mean(a: str, b: str) -> float:
        return s[a] / s[b] if s.get(b, 0.0) > 0 else 0.0

    return {
        "reward/mean": mean("reward_sum", "reward_n"),
        "reward/fresh_mean": mean("fresh_sum", "fresh_n"),
        "reward/replay_mean": mean("replay_sum", "replay_n"),
        "response_length/mean": mean("length_sum", "reward_n"),
        "mismatch/token_mult_prob_error": mean("mismatch_sum", "mismatch_n"),
        "reward/grader_worker_deaths": s.get("grader_deaths", 0.0),
        "tokens/total": s.get("tokens", 0.0),
        "generation/trajectories": s.get("generated_trajectories", 0.0),
        "generation/tokens": s.get("generated_tokens", 0.0),
        **loss_metrics({k: v for d in (reduced.loss_sums, reduced.loss_maxes) for k, v in sorted(d.items())}),
        "grad_norm": max((u.result.grad_norm for u in updates), default=0.0),
        "lr": updates[-1].result.lr if updates else 0.0,
        "optim/skipped_updates": float(sum(u.result.skipped for u in updates)),
    }
