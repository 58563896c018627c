"""Observing training: what each verb of a step produced, handed to observers (`run_training(cfg, observers=[...])`, or
`train.main(argv, observers=[...])` for the whole entry point).

A `StepObserver` overrides the hooks it needs (all do nothing here); `StepObservers.notify(hook, ...)` calls every
observer's hook in order, with the step number first for the hooks of a step (those whose first argument is `step`).
Observers receive the trainer's own objects: they look, they do not steer (mutating what they receive changes the
run). Tests and benches observe a run through these hooks instead of replacing the trainer's functions. Generating
ahead (`rollout.max_staleness` > 0) the generator process plans and generates, so `planned` and `generated` are not
called there.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from exgrpo_megatron.data.step_plan import QuestionGroup
    from exgrpo_megatron.distributed.runtime import ParallelLayout
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.batch import MicroBatch
    from exgrpo_megatron.policy.output_layer import LastStageOutput
    from exgrpo_megatron.policy.train_batch import RolloutRows, TrainBatch
    from exgrpo_megatron.rollout.group_filter import StepRollouts
    from exgrpo_megatron.rollout.types import Sample
    from exgrpo_megatron.training.step_metrics import UpdateMetrics


class StepObserver:
    """The hooks, in the order a run calls them."""

    def distributed(self, layout: ParallelLayout) -> None:
        """The process groups exist (`init_distributed` returned); nothing else of the run is built."""

    def started(self, c: Any) -> None:
        """The run's components are built (before a checkpoint is resumed); `c` is the `components.Components` (not
        imported here: components holds the observers)."""

    def step_started(self, step: int) -> None:
        """A step begins (nothing of it has run)."""

    def planned(self, step: int, groups: list[QuestionGroup]) -> None:
        """The step's global batch of question groups (replays: the trajectory the pool chose, still stored)."""

    def generated(self, step: int, groups: list[QuestionGroup], samples: list[list[Sample]]) -> None:
        """This rank's groups of one generation round (refill rounds too) and their samples."""

    def rolled_out(self, step: int, rollouts: StepRollouts) -> None:
        """This rank's graded groups, filtered and refilled when the algorithm filters."""

    def rows_built(self, step: int, rows: RolloutRows) -> None:
        """The rows of the groups trained on (tokens, rewards, advantages, behaviour log-probs, replay flags)."""

    def batch_ready(self, step: int, batch: TrainBatch) -> None:
        """The rows with their pi_old."""

    def update_started(self, step: int, update: int, micro_batches: list[MicroBatch], phase: Phase,
                       normalisers: tuple[float, float]) -> None:
        """One mini-batch update's micro-batches (with their loss inputs), the phase and its normalisers."""

    def loss_computed(self, step: int, update: int, output: LastStageOutput, micro_batch: MicroBatch, loss: Tensor,
                      metrics: dict[str, Tensor]) -> None:
        """One micro-batch's loss on the last pipeline stage: the model's output, the loss and its metrics."""

    def updated(self, step: int, update: int, metrics: UpdateMetrics) -> None:
        """One mini-batch update done: the optimizer step's result and the loss metrics of its micro-batches."""

    def policy_pass(self, step: int, site: str, micro_batches: list[MicroBatch], forward_only: bool) -> None:
        """Any pass through the policy that runs on this rank, before it runs: `site` names it ("replay_scores",
        "old_logprobs", "update", distributed/lockstep.py); under expert parallelism `micro_batches` may be empty (the
        rank joins the others' pass with padding)."""

    def step_finished(self, step: int, metrics: dict[str, Any]) -> None:
        """The step's logged metrics."""


def _takes_step(hook: str) -> bool:
    return list(inspect.signature(getattr(StepObserver, hook)).parameters)[1:2] == ["step"]


HOOKS: tuple[str, ...] = tuple(name for name in vars(StepObserver) if not name.startswith("_"))
STEP_HOOKS = frozenset(filter(_takes_step, HOOKS))  # a step's hooks; the others describe the run


class StepObservers:
    """Every observer's hook, in order (`notify`), with the current step (set by `begin`) for a step's hooks."""

    def __init__(self, observers: Sequence[StepObserver] = ()) -> None:
        self.observers = list(observers)
        self.step = 0

    def __bool__(self) -> bool:
        return bool(self.observers)

    def begin(self, step: int) -> None:
        self.step = step
        self.notify("step_started")

    def notify(self, hook: str, *args: Any) -> None:
        """Call `hook` (a StepObserver method) of every observer with `args`, led by the current step when the hook
        takes one; a name that is not a hook is a ValueError, raised even with no observer."""
        if hook not in HOOKS:
            raise ValueError(f"{hook!r} is not a StepObserver hook (one of {', '.join(HOOKS)})")
        lead = (self.step,) if hook in STEP_HOOKS else ()
        for o in self.observers:
            getattr(o, hook)(*lead, *args)
