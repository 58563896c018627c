"""Per-step metrics, reduced over data-parallel ranks (each DP rank saw a share of the groups).

Metrics only report: nothing here steers the run (the phase is `experience.schedule`'s, fed by
`schedule.solved_fraction`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from exgrpo_megatron.algo.loss import mult_prob_error_sums
from exgrpo_megatron.policy.policy import UpdateResult
from exgrpo_megatron.policy.train_batch import RolloutRows, TrainBatch


def rollout_mismatch(batch: TrainBatch) -> tuple[float, float]:
    """(sum, count) of exp(|logp_behaviour - logp_trainer|) over fresh response tokens, pi_old recomputed by the
    trainer: 1.0 when the rollout engine and the trainer agree (`algo.loss.token_mult_prob_error`)."""
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


class StepTotals:
    def __init__(self, dp_group: Any = None):
        self.dp_group = dp_group  # the data-parallel gloo group; None: one DP rank
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.loss_sums: dict[str, float] = {}
        self.loss_maxes: dict[str, float] = {}
        self.updates: list[UpdateResult] = []

    def all_reduce_dp(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(t, op=op, group=self.dp_group)
        return t

    def _add(self, **kv: float) -> None:
        for k, v in kv.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def add_rollouts(self, batch: RolloutRows, grader_deaths: int) -> None:
        """Reward / length / token counts of this rank's rows."""
        fresh = [r for r, rep in zip(batch.rewards, batch.is_replay, strict=True) if not rep]
        replay = [r for r, rep in zip(batch.rewards, batch.is_replay, strict=True) if rep]
        lengths = batch.response_lengths
        self._add(reward_sum=sum(batch.rewards), reward_n=len(batch.rewards), fresh_sum=sum(fresh),
                  fresh_n=len(fresh), replay_sum=sum(replay), replay_n=len(replay), length_sum=sum(lengths),
                  tokens=sum(len(s) for s in batch.sequences), grader_deaths=grader_deaths)

    def add_mismatch(self, total: float, count: float) -> None:
        self._add(mismatch_sum=total, mismatch_n=count)

    def add_loss_metrics(self, per_micro: list[dict[str, torch.Tensor]], reduce_op: Callable[[str], str]) -> None:
        for m in per_micro:
            for k, v in m.items():
                if reduce_op(k) == "max":
                    self.loss_maxes[k] = max(self.loss_maxes.get(k, 0.0), float(v))
                else:
                    self.loss_sums[k] = self.loss_sums.get(k, 0.0) + float(v)

    def add_update(self, update: UpdateResult) -> None:
        self.updates.append(update)

    def finish(self, loss_metrics: Callable[[dict[str, float]], dict[str, float]]) -> dict[str, float]:
        """The step's metrics; `loss_metrics` maps the DP-reduced loss metrics to the algorithm's declared ones."""
        keys = sorted(self.sums)
        sums = self.all_reduce_dp(torch.tensor([self.sums[k] for k in keys], dtype=torch.float64))
        s = dict(zip(keys, sums.tolist(), strict=True))
        lkeys = sorted(self.loss_sums)
        lsum = self.all_reduce_dp(torch.tensor([self.loss_sums[k] for k in lkeys] or [0.0], dtype=torch.float64))
        mkeys = sorted(self.loss_maxes)
        lmax = self.all_reduce_dp(torch.tensor([self.loss_maxes[k] for k in mkeys] or [0.0], dtype=torch.float64),
                                  op=dist.ReduceOp.MAX)
        reduced = {**dict(zip(lkeys, lsum.tolist(), strict=False)), **dict(zip(mkeys, lmax.tolist(), strict=False))}

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
            **loss_metrics(reduced),
            "grad_norm": max((u.grad_norm for u in self.updates), default=0.0),
            "lr": self.updates[-1].lr if self.updates else 0.0,
            "optim/skipped_updates": float(sum(u.skipped for u in self.updates)),
        }
