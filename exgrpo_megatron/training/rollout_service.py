"""The rollout service: question groups in, sampled and graded groups out.

One owner of wake -> generate (each engine batch's groups go to a grading sink as soon as they finish, so
grading overlaps generation) -> sleep, of the refit timing and of the sampling seeds. The training step,
in-training validation and the generator process of a run generating ahead (async_generation/) generate through
it with the reward grader's sink (`StreamingGrading`, the grader pool); benchmark evaluation (evaluate.py) with its
own (`BenchmarkSink`: boxed + Math-Verify labels per sample), inside one `awake()` span for all its engine calls.

Seeds: a step's generation round r samples with `rollout_seed(seed, step, r)`; per-request seeds are the question
ids (rollout/groups.py; evaluate.py: the unique question's index), so a question's samples do not depend on
which rank, process or batch generates it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

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


ResultT = TypeVar("ResultT", covariant=True)


class GradingSink(Protocol[ResultT]):
    """Where generated groups go as they finish: `submit(indices, samples)` (group indices into the call's groups,
    one sample list per group) returns at once; `result()` then waits for the verdicts of every group."""

    def submit(self, indices: list[int], samples: list[list[Sample]]) -> None: ...

    def result(self) -> ResultT: ...


SinkT = TypeVar("SinkT", bound=GradingSink[Any])


@dataclass
class Generated(Generic[SinkT]):
    samples: list[list[Sample]]  # per group, in the groups' order
    grading: SinkT  # under way; `.result()` waits for the verdicts
    refit_seconds: float  # seconds the engine spent refitting its weights first (vLLM; part of generation)


GeneratedGroups = Generated[StreamingGrading]  # graded by the reward grader (training, validation)


class RolloutService:
    """Generation and grading for this process (`engine`: this rank's rollout engine; `grader`: its reward pool,
    None where only `generate_into` with a caller's sink is used: evaluate.py)."""

    def __init__(self, engine: RolloutEngine, grader: GraderPool | None = None, tokenizer: Tokenizer | None = None,
                 require_think: bool = False) -> None:
        self.engine, self.grader, self.tokenizer, self.require_think = engine, grader, tokenizer, require_think
        self._awake = False

    @contextmanager
    def awake(self) -> Iterator[None]:
        """The engine awake for the block: wake, then sleep after it; inside an `awake()` block already, nothing."""
        if self._awake:
            yield
            return
        self.engine.wake()
        self._awake = True
        try:
            yield
        finally:
            self._awake = False
        self.engine.sleep()  # not after an error: the run stops there

    def generate_into(self, groups: list[QuestionGroup], n: int, params: SamplingParams,
                      sink: SinkT) -> Generated[SinkT]:
        """n samples per group (a replayed group: n-1 and its stored trajectory), each engine batch's groups
        submitted to `sink` as they finish. Request seeds are the groups' qids (rollout/groups.py)."""
        refit_before = self.refit_seconds_total()  # vLLM refits before generating when its weights are stale
        with self.awake():
            samples = generate_groups(self.engine, groups, n, params, on_chunk=sink.submit)
        return Generated(samples, sink, self.refit_seconds_total() - refit_before)

    def generate(self, groups: list[QuestionGroup], n: int, params: SamplingParams) -> GeneratedGroups:
        """`generate_into` the reward grader's sink: one reward per sample."""
        if self.grader is None or self.tokenizer is None:
            raise ValueError("RolloutService.generate: this service has no reward grader; use generate_into")
        return self.generate_into(groups, n, params,
                                  StreamingGrading(self.grader, self.tokenizer, groups, self.require_think))

    def training_round(self, groups: list[QuestionGroup], n: int, sampling: SamplingParams, seed: int, step: int,
                       refill_round: int = 0) -> GeneratedGroups:
        """A training step's generation round, at its seed."""
        return self.generate(groups, n, replace(sampling, seed=rollout_seed(seed, step, refill_round)))

    def rewards(self, groups: list[QuestionGroup], n: int, params: SamplingParams) -> list[float]:
        """The rewards of n samples per group, flat, group by group (in-training validation)."""
        return self.generate(groups, n, params).grading.result().rewards

    def refit_seconds_total(self) -> float:
        return float(getattr(self.engine, "refit_seconds_total", 0.0))

    def close(self) -> None:
        """Stop the grader's worker processes."""
        if self.grader is not None:
            self.grader.close()
