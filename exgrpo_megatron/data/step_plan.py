"""Compose one step's global batch of question groups: fresh prompts plus replayed experience.

Warm-up: B fresh questions. Mixed mode: n_exp = min(floor(rho * B), |pool|) experience questions
(paper section 4.2) plus B - n_exp fresh ones -- only what is used is drawn from the sampler (the
original drew B and discarded n_exp of them). The plan is identical on every rank; each DP rank
then takes its contiguous share (`local_groups`).
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
) -> list[QuestionGroup]:
    replays = []
    if pool is not None and replay_on:
        replays = pool.sample(experience_quota(batch_size, experience_ratio), step_seed, scorer)
    skip = pool.retired_ids() if pool is not None else frozenset()
    fresh = sampler.draw(batch_size - len(replays), skip=skip)
    groups = [QuestionGroup(q, dataset[q].prompt_ids, dataset[q].answer) for q in fresh]
    groups += [QuestionGroup(c.qid, dataset[c.qid].prompt_ids, dataset[c.qid].answer, c.trajectory, c.bucket,
                             c.current_logprobs) for c in replays]
    return groups


def local_groups(groups: list[QuestionGroup], dp_rank: int, dp_size: int) -> list[QuestionGroup]:
    """This DP rank's share: every dp_size-th group, so fresh and replayed groups spread evenly
    (the batch size is validated to divide by DP)."""
    return groups[dp_rank::dp_size]
