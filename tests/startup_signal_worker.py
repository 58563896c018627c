"""The real entry point (`exgrpo_megatron.train.main`) with a SIGTERM sent to itself at one start-up point,
for tests/test_startup_preemption.py. Imports nothing heavy before main() (the handler must come first).

    python -m tests.startup_signal_worker POINT -- TRAIN_ARGS...

POINT: config (inside load_config), distributed (right after init_distributed: the observers' `distributed` hook),
components (right after build_components, the `started` hook: model, optimizer, grader pool exist), resume (inside
checkpoint selection + load, after the checkpoint was verified), none (no self-signal: the parent signals from
outside)."""

from __future__ import annotations

import os
import signal
import sys


def _signal_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _after(module, name: str) -> None:
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        _signal_self()
        return out

    setattr(module, name, wrapped)


def install(point: str) -> list:
    """Signal at `point`: the trainer's start-up points through its observer hooks, the config and checkpoint
    modules' functions (not the trainer's) by wrapping them. Returns the observers for train.main."""
    from exgrpo_megatron.training.step_observer import StepObserver

    class SignalAt(StepObserver):
        def distributed(self, layout) -> None:
            if point == "distributed":
                _signal_self()

        def started(self, c) -> None:
            if point == "components":
                _signal_self()

    if point == "config":
        from exgrpo_megatron.config import loader

        _after(loader, "load_config")
    elif point == "resume":
        from exgrpo_megatron.checkpoint import resume

        _after(resume, "load_checkpoint")
    return [SignalAt()]


def main(argv: list[str]) -> int:
    from exgrpo_megatron import train

    point, rest = argv[0], argv[argv.index("--") + 1:]
    return train.main(rest, observers=install(point) if point != "none" else ())


if __name__ == "__main__":  # dist_checkpointing starts spawned helpers
    sys.exit(main(sys.argv[1:]))
