"""The algorithm's group filter with refill (DAPO's dynamic sampling, for any algorithm whose `keep_group`
drops groups), identical on every data-parallel rank.

Each DP rank generates and grades its share of the step's groups. The ranks exchange how many of their groups
the filter kept; while some rank has fewer than its share and fewer than `max_rounds` extra rounds ran, every
rank draws the same fresh questions (the sampler is replicated) -- as many as the ranks together lack -- and
each rank takes the contiguous slice that covers its own deficit (`refill_slices`), so the decision and the
draw depend only on the exchanged counts. If the cap is reached short, every rank trains on the same number of
groups: the smallest kept count (its first kept groups). Every graded group, kept or dropped, is returned for
the experience pool (retirement and buckets see every group) and the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.rollout.types import Sample

GradedRound = tuple[list[list[Sample]], list[list[float]]]  # (samples, rewards) of the given groups


@dataclass
class StepRollouts:
    """This rank's groups of one step: the ones to train on, and every graded one."""

    groups: list[QuestionGroup]  # trained on, in batch order
    samples: list[list[Sample]]
    rewards: list[list[float]]
    graded_groups: list[QuestionGroup] = field(default_factory=list)  # every graded group (kept or dropped)
    graded_samples: list[list[Sample]] = field(default_factory=list)
    graded_rewards: list[list[float]] = field(default_factory=list)
    dropped: int = 0  # DP-global: graded groups not trained on
    rounds: int = 0  # extra generation rounds run

    @classmethod
    def unfiltered(cls, groups: list[QuestionGroup], samples: list[list[Sample]],
                   rewards: list[list[float]]) -> StepRollouts:
        return cls(groups, samples, rewards, groups, samples, rewards)


def refill_slices(deficits: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) of each rank's share of a draw of sum(deficits) fresh questions: rank r covers its deficit."""
    out, start = [], 0
    for d in deficits:
        out.append((start, start + d))
        start += d
    return out


def kept_counts(n_kept: int, dp_group: Any, dp_rank: int, dp_size: int) -> list[int]:
    """Every rank's kept-group count (a SUM all-reduce of one-hot counts; no group: one rank)."""
    counts = torch.zeros(dp_size, dtype=torch.int64)
    counts[dp_rank] = n_kept
    if dp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    return [int(x) for x in counts.tolist()]


def filter_and_refill(keep: Callable[[Sequence[float]], bool], first: StepRollouts, *,
                      generate_round: Callable[[list[QuestionGroup], int], GradedRound],
                      draw_fresh: Callable[[int], list[QuestionGroup]], max_rounds: int,
                      dp_group: Any = None, dp_rank: int = 0, dp_size: int = 1) -> StepRollouts:
    """Apply `keep` to the first round's graded groups and refill (module doc). `generate_round(groups, round)`
    generates and grades this rank's groups of extra round `round` (1, 2, ...); `draw_fresh(n)` draws n fresh
    questions, the same on every rank."""
    target = len(first.groups)
    groups, samples, rewards = list(first.groups), list(first.samples), list(first.rewards)
    kept = [i for i, r in enumerate(rewards) if keep(r)]
    counts = kept_counts(len(kept), dp_group, dp_rank, dp_size)
    rounds = 0
    while min(counts) < target and rounds < max_rounds:
        rounds += 1
        deficits = [max(target - k, 0) for k in counts]
        start, stop = refill_slices(deficits)[dp_rank]
        mine = draw_fresh(sum(deficits))[start:stop]
        new_samples, new_rewards = generate_round(mine, rounds)
        for g, s, r in zip(mine, new_samples, new_rewards, strict=True):
            if keep(r):
                kept.append(len(groups))
            groups.append(g)
            samples.append(s)
            rewards.append(r)
        counts = kept_counts(len(kept), dp_group, dp_rank, dp_size)
    train = kept[:min(min(counts), target)]
    graded_total = kept_counts(len(groups), dp_group, dp_rank, dp_size)
    return StepRollouts([groups[i] for i in train], [samples[i] for i in train], [rewards[i] for i in train],
                        groups, samples, rewards, dropped=sum(graded_total) - len(train) * dp_size, rounds=rounds)
