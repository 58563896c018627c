"""Watching the generator process from the trainer: is it alive, is it late, and what to call it when it is not.

The generator answers one request at a time (generator.py). The trainer measures each round -- the request sent,
its weights sent, the answer received -- and expects every answer within

    deadline = max(rollout.generator.deadline_min_seconds, rollout.generator.deadline_factor x the slowest round so far)

counted from the moment the round's request went out (the generator is idle between rounds). Until the first answer
arrives nothing has been measured: start-up (spawn, imports, model, engine, grader) and the first round together get
rollout.generator.startup_timeout_seconds, counted from the process start. A generator that misses its deadline
(stopped, hung in a collective, swapping) or dies (a signal, the OOM killer, an error) raises GeneratorFailed on the
trainer with its pid and what the kernel says of it; the trainer saves its last whole step and exits
EXIT_GENERATOR_FAILED (trainer.py). A step is never trained on rollouts that did not all arrive.

A preemption signal (SIGTERM / SIGUSR1) received by the trainer's rank 0 while it waits is looked at every second too:
a generator that is stopped, or whose round has already run longer than the slowest round measured so far (hung, or
slower than it has ever been), is not waited for -- it is killed, PreemptedWhileWaiting is raised on every rank, and
the trainer saves its last whole step and exits 75 at once (the rollouts not received are marked lost, as after an
exit 4). A generator still inside its usual round time is waited for, so that the requeued run stays bitwise equal.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

EXIT_GENERATOR_FAILED = 4  # the generator died or missed its deadline; the last whole step is saved
_PROC_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a tracer", "D": "in uninterruptible sleep "
                "(waiting on the disk or a device)", "Z": "dead (a zombie)", "S": "sleeping (waiting on something)",
                "R": "running"}


class GeneratorFailed(RuntimeError):
    """The generator died or missed its deadline (the message names it); no step was trained on a partial answer."""


class PreemptedWhileWaiting(RuntimeError):
    """A preemption signal arrived while the trainer waited for a stopped or late generator (the message says which);
    the generator is killed and not waited for."""


@dataclass
class Deadline:
    """Seconds the trainer waits for a round's answer, from the rounds measured so far (module doc)."""

    factor: float
    min_seconds: float
    startup_seconds: float
    slowest_round: float = 0.0
    rounds: int = 0

    def observe(self, seconds: float) -> None:
        self.slowest_round = max(self.slowest_round, seconds)
        self.rounds += 1

    def seconds(self) -> float:
        if not self.rounds:
            return self.startup_seconds
        return max(self.min_seconds, self.factor * self.slowest_round)

    def usual(self, seconds: float) -> bool:
        """Is a round that has run `seconds` so far still within the rounds measured (False before any)?"""
        return self.rounds > 0 and seconds <= self.slowest_round

    def explain(self) -> str:
        if not self.rounds:
            return (f"rollout.generator.startup_timeout_seconds={self.startup_seconds:g} (start-up and the first "
                    "round)")
        return (f"max(rollout.generator.deadline_min_seconds={self.min_seconds:g}, rollout.generator.deadline_factor="
                f"{self.factor:g} x the slowest of {self.rounds} rounds so far, {self.slowest_round:.1f} s)")


def process_state(pid: int) -> str:
    """What the kernel says of `pid` (Linux /proc), e.g. 'stopped (SIGSTOP or a debugger)'; '' where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            code = fh.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""
    return _PROC_STATES.get(code, f"state {code}")


def exit_text(exitcode: int | None) -> str:
    """multiprocessing's exit code in words: 'killed by SIGKILL', 'exited with status 1'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"
