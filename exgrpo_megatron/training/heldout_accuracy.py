"""In-training validation: avg@k accuracy on the held-out set (paper: temperature 0.6).

Generated and graded by the run's rollout service (rollout_service.py) as a training step is: grading overlaps
generation, and the rewards come back in the same order as grading everything after generation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from exgrpo_megatron.data.datasets import PromptDataset
from exgrpo_megatron.data.step_plan import QuestionGroup, local_groups
from exgrpo_megatron.rollout.types import SamplingParams
from exgrpo_megatron.training.components import Components


def validate_accuracy(c: Components, val_data: PromptDataset, step: int) -> dict[str, float]:
    cfg = c.cfg
    groups = [QuestionGroup(q, val_data[q].prompt_ids, val_data[q].answer) for q in val_data.qids()]
    mine = local_groups(groups, c.layout.dp_rank, c.layout.dp_size)
    params = SamplingParams(max_new_tokens=cfg.data.max_response_length, temperature=cfg.rollout.val_temperature,
                            top_p=cfg.rollout.val_top_p, stop_strings=list(cfg.rollout.stop), seed=10_007 + step)
    rewards = c.rollout.rewards(mine, cfg.trainer.val_n, params)
    totals = torch.tensor([sum(rewards), float(len(rewards))], dtype=torch.float64)
    if c.layout.dp_size > 1:
        from megatron.core import parallel_state as ps

        dist.all_reduce(totals, group=ps.get_data_parallel_group_gloo())
    return {f"val/avg@{cfg.trainer.val_n}": float(totals[0] / max(float(totals[1]), 1.0))}
