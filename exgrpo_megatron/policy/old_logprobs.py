"""pi_old of every row of a step: the log-probs of its response tokens under the weights the step starts from.

Fresh rows were sampled by the rollout engine from exactly these weights, and the engine returns the sampled
tokens' log-probs (rollout/types.py contract: log_softmax(logits / T)). Where the engine computes them as the
policy does, those ARE pi_old and a second forward pass buys nothing:
  - the megatron engine in fp32 (the policy's own modules; 1.5e-7 from a recompute);
  - vLLM in fp32 with top_p = 1 and top-k off (with top-p/top-k vLLM versions differ on renormalisation).
Elsewhere (a bf16 engine, or generation ahead of training) pi_old is the trainer's: the update's own forward
(`training_forward`, one update per step: this module then returns None and the loss detaches its log-probs) or a
forward pass of every row here (`recompute`); config/pi_old_source.py decides which.

Replayed rows were sampled long ago (their recorded log-probs are pi_behaviour, the replay ratio's denominator,
docs/exgrpo.md), so their pi_old still needs the current weights. The trajectory-selection pass
(policy/replay_scores.py) already ran every candidate through the current policy before any update of this step; it
keeps the log-probs at the rollout (= loss) temperature and the chosen trajectory's travel with the replay choice.
Only replayed rows the selection did not score (a single stored candidate, metric random) are run forward here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.policy.policy import Policy
from exgrpo_megatron.policy.train_batch import RolloutRows, token_stats


def replay_current_logprobs(groups: Sequence[QuestionGroup], batch: RolloutRows) -> list[np.ndarray | None]:
    """Per row: the selection pass's current-policy log-probs of a replayed row (None for fresh rows and for
    replays that were not scored). `groups` are this rank's QuestionGroups, in batch.group_index order."""
    return [groups[g].replay_current_logprobs if rep else None
            for g, rep in zip(batch.group_index, batch.is_replay, strict=True)]


def old_logprobs(policy: Policy, batch: RolloutRows, replay_current: list[np.ndarray | None], source: str, *,
                 temperature: float, max_tokens: int) -> tuple[list[torch.Tensor] | None, int]:
    """(pi_old per row, number of rows that needed a forward pass here).

    recompute: one forward of every row. rollout: fresh rows take the behaviour (engine's) log-probs, replayed rows the
    selection pass's (`replay_current`), and only replayed rows without them are run forward. training_forward: None
    (the step's one update takes its own forward's log-probs, detached), no pass here.
    """
    n = len(batch.sequences)
    if source == "training_forward":
        return None, 0
    if source == "recompute":
        forward = list(range(n))
    elif source == "rollout":
        forward = [i for i in range(n) if batch.is_replay[i] and replay_current[i] is None]
    else:
        raise ValueError(f"old log-prob source must be 'rollout', 'training_forward' or 'recompute', got {source!r}")
    experts = None if batch.expert_choices is None else [batch.expert_choices[i] for i in forward]
    computed = token_stats(policy, [batch.sequences[i] for i in forward], [batch.prompt_lengths[i] for i in forward],
                           site="old_logprobs", temperature=temperature, with_entropy=False, max_tokens=max_tokens,
                           expert_choices=experts).logprobs
    old: list[torch.Tensor | None] = [None] * n
    for i, lp in zip(forward, computed, strict=True):
        old[i] = lp
    for i in range(n):
        if old[i] is not None:
            continue
        if not batch.is_replay[i]:
            old[i] = batch.behaviour_logprobs[i].clone()
            continue
        cur = torch.as_tensor(np.asarray(replay_current[i]), dtype=torch.float32)
        if cur.numel() != batch.response_lengths[i]:
            raise ValueError(f"row {i}: {cur.numel()} selection log-probs for {batch.response_lengths[i]} tokens")
        old[i] = cur.clone()
    return old, len(forward)  # type: ignore[return-value]
