"""Group-relative advantages (GRPO / Dr.GRPO) for ExGRPO's mixed groups.

Source: paper §3.1 (Dr.GRPO: no std, no length normalisation) and docs/exgrpo.md
(`compute_grpo_outcome_advantage` with `grpo_use_std=False`). A group holds the K rollouts of one
question; for a replayed question it mixes the replayed trajectory o* and K-1 fresh rollouts, so with
k successes among the K members the replay (reward 1) gets A(o*) = 1 - k/K. The advantage is one
number per sequence, broadcast to every response token by the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    std_normalize: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Per-sequence advantages A_i = (r_i - mean_{j in G} r_j) [/ (std_{j in G} r_j + eps)].

    rewards: `[G, K]` (one row per group), or flat `[G*K]` with `group_size=K` (consecutive
      members of one group are adjacent). The result has the same shape as `rewards`.
    std_normalize: False (default) is Dr.GRPO / the ExGRPO code (`grpo_use_std=False`): no division.
      True divides by the unbiased group std plus `eps` (verl's original GRPO).
    A group of size 1 has nothing to compare with; following verl it gets mean 0 and std 1, i.e. A = r.
    Computed in at least float32 (float64 stays float64).
    """
    if rewards.dim() == 1:
        if group_size is None or group_size < 1 or rewards.numel() % group_size != 0:
            raise ValueError(f"flat rewards of length {rewards.numel()} need a group_size that divides it")
        grouped = rewards.reshape(-1, group_size)
    elif rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size={group_size} disagrees with rewards of shape {tuple(rewards.shape)}")
        grouped = rewards
    else:
        raise ValueError(f"rewards must be [G, K] or flat [G*K], got shape {tuple(rewards.shape)}")

    grouped = grouped.to(torch.promote_types(grouped.dtype, torch.float32))
    k = grouped.shape[1]
    if k == 1:
        mean = torch.zeros_like(grouped)
        std = torch.ones_like(grouped)
    else:
        mean = grouped.mean(dim=1, keepdim=True)
        std = grouped.std(dim=1, unbiased=True, keepdim=True)
    advantages = grouped - mean
    if std_normalize:
        advantages = advantages / (std + eps)
    return advantages.reshape(rewards.shape)
