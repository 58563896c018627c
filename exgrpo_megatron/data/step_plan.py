"""Compose one step's global batch of question groups: fresh prompts plus replayed experience.

Warm-up: B fresh questions. Mixed mode: n_exp = min(floor(rho * B), |pool|) experience questions
(paper section 4.2) plus, by `experience.placement`:
  displace (the paper): B - n_exp fresh ones -- only what is used is drawn from the sampler (the original drew B
    and discarded n_exp of them); the step trains on B groups;
  append: all B fresh ones, the replayed questions on top -- B + n_exp groups (rollout-level replay that adds to
    the fresh data instead of taking its place, arXiv 2606.04560). Each replayed group is still K-1 fresh rollouts
    + the stored trajectory, so a step generates B*K + n_exp*(K-1) trajectories. The loss needs nothing else: its
    normalisers come from the DP-global token and sequence counts of each update's rows (algo/loss.py), so the
    larger batch is averaged over its own sequences, as a GRPO batch of B + n_exp questions would be.
The plan is identical on every rank; each DP rank then takes every dp_size-th group (`local_groups`): with append,
B + n_exp need not divide by DP, and a rank may hold one group more than another (each still holds >= B / DP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from exgrpo_megatron.data.datasets import PromptDataset
from exgrpo_megatron.data.sampler import PromptSampler
from exgrpo_megatron.experience.selection import Scorer
from exgrpo_megatron.experience.sharded import ShardedExperiencePool
from exgrpo_megatron.experience.types import Trajectory

PLACEMENTS = ("displace", "append")


@dataclass(frozen=True)
class QuestionGroup:
    qid: int
    prompt_ids: list[int]
    answer: str
    replay: Trajectory | None = None  # the stored trajectory spliced in as the K-th sample
    bucket: int | None = None
    replay_current_logprobs: np.ndarray | None = None  # its log-probs under the current policy (selection pass)


def experience_quota(batch_size: int, experience_ratio: float) -> int:
    """floor(rho * B): the experience questions a mixed step asks the pool for; the pool draws
    n_exp = min(floor(rho * B), |E|) of them (paper section 4.2, `ShardedExperiencePool.sample`)."""
    return math.floor(experience_ratio * batch_size)


def compose_step(
    dataset: PromptDataset,
    sampler: PromptSampler,
    pool: ShardedExperiencePool | None,
    *,
    replay_on: bool,
    batch_size: int,
    experience_ratio: float,
    step_seed: int,
    scorer: Scorer | None,
    placement: str = "displace",
) -> list[QuestionGroup]:
    """The step's groups: the fresh ones first, then the replayed ones sorted by qid (module docstring)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown replay placement {placement!r}; expected one of {PLACEMENTS}")
    replays = []
    if pool is not None and replay_on:
        replays = pool.sample(experience_quota(batch_size, experience_ratio), step_seed, scorer)
    skip = pool.retired_ids() if pool is not None else frozenset()
    fresh = sampler.draw(batch_size - (len(replays) if placement == "displace" else 0), skip=skip)
    groups = [QuestionGroup(q, dataset[q].prompt_ids, dataset[q].answer) for q in fresh]
    groups += [QuestionGroup(c.qid, dataset[c.qid].prompt_ids, dataset[c.qid].answer, c.trajectory, c.bucket,
                             c.current_logprobs) for c in replays]
    return groups


def local_groups(groups: list[QuestionGroup], dp_rank: int, dp_size: int) -> list[QuestionGroup]:
    """This DP rank's share: every dp_size-th group, so fresh and replayed groups spread evenly (B is validated
    to divide by DP; with append the n_exp replayed groups on top may leave one rank a group more)."""
    return groups[dp_rank::dp_size]
