"""Fresh groups enlarged by their questions' stored responses (in-group and rescue replay), and what the response
store learns from a step (experience/response_store.py).

`with_stored_responses` runs on every DP rank after grading and before the batch is built (the store's `fetch` is a
collective): each trained group keeps its K fresh samples and gains the stored responses the algorithm's rule
chooses (`ResponseReplay.chosen`), appended after the fresh ones as replayed samples with their recorded behaviour
log-probs and rewards; nothing is generated for them. Only the trained part of `StepRollouts` grows: the graded
groups stay the generated ones, so the pool hook, the schedule and the `generation/*` counts see what was generated.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from exgrpo_megatron.experience.response_store import ResponseStore, StoredResponse
from exgrpo_megatron.rollout.group_filter import StepRollouts
from exgrpo_megatron.rollout.splice import stored_sample
from exgrpo_megatron.rollout.types import Sample


def with_stored_responses(store: ResponseStore, rollouts: StepRollouts) -> StepRollouts:
    """`rollouts` whose trained groups gain their stored responses (collective over the store's DP group)."""
    stored = store.fetch([g.qid for g in rollouts.groups])
    samples, rewards = [], []
    for g, fresh, fresh_rewards in zip(rollouts.groups, rollouts.samples, rollouts.rewards, strict=True):
        gained = store.replay.chosen(stored.get(g.qid, []), fresh_rewards)
        samples.append([*fresh, *(stored_sample(g.prompt_ids, r.token_ids.tolist(), r.logprobs.tolist())
                                  for r in gained)])
        rewards.append([*fresh_rewards, *(r.reward for r in gained)])
    return dataclasses.replace(rollouts, samples=samples, rewards=rewards)


def stored_outcomes(rollouts: StepRollouts, step: int) -> list[tuple[int, list[StoredResponse]]]:
    """Every graded group's generated responses, for the store (`ResponseStore.update`), in sample order."""
    def stored(samples: list[Sample], rewards: list[float]) -> list[StoredResponse]:
        return [StoredResponse(np.asarray(s.response_ids, dtype=np.int32), np.asarray(s.logprobs, dtype=np.float32),
                               float(r), step) for s, r in zip(samples, rewards, strict=True) if not s.is_replay]

    return [(g.qid, stored(samples, rewards)) for g, samples, rewards in
            zip(rollouts.graded_groups, rollouts.graded_samples, rollouts.graded_rewards, strict=True)]
