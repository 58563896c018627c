"""The rollout service: question groups in, sampled and graded groups out.

One owner of wake -> generate (each engine batch's groups go to the grader pool as soon as they finish, so
grading overlaps generation) -> sleep, and of the sampling seeds. The training step, in-training validation
and the generator process of a run generating ahead (ahead/generator.py) all generate through it.

Seeds: a step's generation round r samples with `rollout_seed(seed, step, r)`; per-request seeds are the question
ids (rollout/groups.py), so a question's samples do not depend on which rank or process generates it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.data.tokenizer import Tokenizer
from exgrpo_megatron.reward.grader import GraderPool
from exgrpo_megatron.reward.rollout_rewards import StreamingGrading
from exgrpo_megatron.rollout.groups import generate_groups
from exgrpo_megatron.rollout.types import RolloutEngine, Sample, SamplingParams


def step_seed(seed: int, step: int) -> int:
    """The seed of everything a step draws (its plan's replay choices, its first generation round)."""
    return (seed * 1_000_003 + step) % (2**31)


def rollout_seed(seed: int, step: int, refill_round: int) -> int:
    """The sampling seed of a step's generation round (round 0: the step's seed; refill rounds their own)."""
    return step_seed(seed, step) if refill_round == 0 else step_seed(seed * 7919 + refill_round, step)


@dataclass
class GeneratedGroups:
    samples: list[list[Sample]]  # per group, in the groups' order
    grading: StreamingGrading  # under way; `.result()` waits for the rewards
    refit_seconds: float  # seconds the engine spent refitting its weights first (vLLM; part of generation)


class RolloutService:
    """Generation and grading for this process (`engine`: this rank's rollout engine; `grader`: its pool)."""

    def __init__(self, engine: RolloutEngine, grader: GraderPool, tokenizer: Tokenizer, require_think: bool) -> None:
        self.engine, self.grader, self.tokenizer, self.require_think = engine, grader, tokenizer, require_think

    def generate(self, groups: list[QuestionGroup], n: int, params: SamplingParams) -> GeneratedGroups:
        """n samples per group (a replayed group: n-1 and its stored trajectory), graded as they finish."""
        grading = StreamingGrading(self.grader, self.tokenizer, groups, self.require_think)
        refit_before = self.refit_seconds_total()  # vLLM refits before generating when its weights are stale
        self.engine.wake()
        samples = generate_groups(self.engine, groups, n, params, on_chunk=grading.submit)
        self.engine.sleep()
        return GeneratedGroups(samples, grading, self.refit_seconds_total() - refit_before)

    def training_round(self, groups: list[QuestionGroup], n: int, sampling: SamplingParams, seed: int, step: int,
                       refill_round: int = 0) -> GeneratedGroups:
        """A training step's generation round, at its seed."""
        return self.generate(groups, n, replace(sampling, seed=rollout_seed(seed, step, refill_round)))

    def rewards(self, groups: list[QuestionGroup], n: int, params: SamplingParams) -> list[float]:
        """The rewards of n samples per group, flat, group by group (validation and evaluation)."""
        return self.generate(groups, n, params).grading.result().rewards

    def refit_seconds_total(self) -> float:
        return float(getattr(self.engine, "refit_seconds_total", 0.0))

    def close(self) -> None:
        """Stop the grader's worker processes."""
        self.grader.close()
