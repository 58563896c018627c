"""Replayed trajectories are never regenerated: the stored one is spliced in as the K-th sample.

ExGRPO (docs/exgrpo.md, "Effective group G_q* = {o*} ∪ {o_1..o_{K-1}}"): for an
experience question the engine generates K-1 fresh samples and the pool's trajectory o* joins
them. Unlike the reference code (which re-prefills o* as a forced prefix and throws away the
continuation), o* is appended here with its recorded behaviour log-probs and `is_replay=True`.
"""

from __future__ import annotations

from exgrpo_megatron.rollout.types import Sample


def splice_replay(
    fresh: list[Sample],
    replay_prompt_ids: list[int],
    replay_response_ids: list[int],
    replay_behaviour_logprobs: list[float],
) -> list[Sample]:
    """Return `fresh + [replay]` (the replay is last, index K-1), leaving `fresh` unmodified.

    The replay sample has `finish_reason="replay"`, `is_replay=True` and the recorded log-probs
    (one per response token). Every fresh sample must be for the same prompt.
    """
    for i, s in enumerate(fresh):
        if s.is_replay:
            raise ValueError(f"fresh[{i}] is already a replay")
        if list(s.prompt_ids) != list(replay_prompt_ids):
            raise ValueError(f"fresh[{i}] was generated for a different prompt than the replayed trajectory")
    if len(replay_behaviour_logprobs) != len(replay_response_ids):
        raise ValueError(
            f"{len(replay_behaviour_logprobs)} behaviour log-probs for {len(replay_response_ids)} replay tokens"
        )
    return [*fresh, stored_sample(replay_prompt_ids, replay_response_ids, replay_behaviour_logprobs)]


def stored_sample(prompt_ids: list[int], response_ids: list[int], behaviour_logprobs: list[float]) -> Sample:
    """A stored response as a sample of its group: `finish_reason="replay"`, `is_replay=True`, the recorded
    behaviour log-probs (one per response token)."""
    return Sample(prompt_ids=list(prompt_ids), response_ids=list(response_ids),
                  logprobs=[float(x) for x in behaviour_logprobs], finish_reason="replay", is_replay=True)
