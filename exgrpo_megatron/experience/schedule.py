"""The one owner of the training phase (docs/exgrpo.md, delayed start): warm-up -> collecting -> mixed.

  warm-up     fresh prompts only; the fresh tokens keep the PPO clip; the pool collects nothing (questions solved
              past experience.retire_correct_above still retire, from step 1);
  collecting  the step after a step's solved fraction exceeded `experience.delayed_start_pass_rate` (or step 1 when
              it is <= 0): the mixed-phase loss (no clip) and the pool collects the step's correct trajectories, but
              the pool is still empty so nothing is replayed;
  mixed       from the next step on, for good: replayed experience in every batch, collected every step.

solved fraction = (# responses with reward 1) / (K * B) over all responses of the step, DP-global
([C] `mix_trainer_experience.py:538` batch/solved; [P] "batch Pass@1 exceeds 35%", default 0.35).
On-policy GRPO (no pool, `enabled=False`) stays in warm-up for the whole run, as the on-policy Dr.GRPO baseline
does. Everyone else asks `phase` (and `collects`; a batch holds replayed experience in `Phase.MIXED`); only
`end_step` moves it. The phase is part of the checkpointed trainer state (`state_dict`); checkpoints written before
this class map through `legacy_state`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist


class Phase(Enum):
    WARMUP = "warmup"
    COLLECTING = "collecting"
    MIXED = "mixed"


class ExperienceSchedule:
    def __init__(self, start_sratio: float, enabled: bool = True) -> None:
        self.start_sratio = float(start_sratio)
        self.enabled = enabled
        starts_on = enabled and self.start_sratio <= 0.0
        self.phase = Phase.COLLECTING if starts_on else Phase.WARMUP
        self.switched_at_step: int | None = 0 if starts_on else None

    @property
    def collects(self) -> bool:
        """Does the pool store this step's correct trajectories (retirement happens in every phase)?"""
        return self.phase is not Phase.WARMUP

    def end_step(self, solved_fraction: float, step: int) -> Phase:
        """Move on after a step (its pool update done): collecting -> mixed; warm-up -> collecting when the
        step's solved fraction exceeds the start ratio. Returns the next step's phase."""
        if self.phase is Phase.COLLECTING:
            self.phase = Phase.MIXED
        elif self.phase is Phase.WARMUP and self.enabled and solved_fraction > self.start_sratio:
            self.phase = Phase.COLLECTING
            self.switched_at_step = step
        return self.phase

    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase.value, "switched_at_step": self.switched_at_step,
                "start_sratio": self.start_sratio}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase = Phase(state["phase"]) if self.enabled else Phase.WARMUP
        self.switched_at_step = state.get("switched_at_step")


def legacy_state(switch: dict[str, Any], collected_once: bool) -> dict[str, Any]:
    """The schedule state of a checkpoint from before this class (trainer state "switch" = the delayed-start
    switch's {is_on, switched_at_step, start_sratio} and "collected_once" = the pool has collected once)."""
    phase = Phase.WARMUP if not switch["is_on"] else (Phase.MIXED if collected_once else Phase.COLLECTING)
    return {"phase": phase.value, "switched_at_step": switch.get("switched_at_step"),
            "start_sratio": switch.get("start_sratio")}


def solved_fraction(rewards: Sequence[float], dp_group: dist.ProcessGroup | None) -> float:
    """DP-global share of this step's responses with reward 1 (rewards are 0/1): the schedule's input.
    `dp_group` None: one data-parallel rank (no reduction)."""
    solved = torch.tensor([sum(rewards), float(len(rewards))], dtype=torch.float64)
    if dp_group is not None:
        dist.all_reduce(solved, group=dp_group)
    return float(solved[0] / max(float(solved[1]), 1.0))
