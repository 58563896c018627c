"""The real entry point (`exgrpo_megatron.train.main`) with a SIGTERM sent to itself at one start-up point,
for tests/test_startup_preemption.py. Imports nothing heavy before main() (the handler must come first).

    python -m tests.startup_signal_worker POINT -- TRAIN_ARGS...

POINT: config (inside load_config), distributed (right after init_distributed), components (right after
build_components: model, optimizer, grader pool exist), resume (inside checkpoint selection + load, after
the checkpoint was verified), none (no self-signal: the parent signals from outside).
"""

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


def install(point: str) -> None:
    if point == "config":
        from exgrpo_megatron.config import loader

        _after(loader, "load_config")
    elif point in ("distributed", "components"):
        from exgrpo_megatron import trainer

        _after(trainer, "init_distributed" if point == "distributed" else "build_components")
    elif point == "resume":
        from exgrpo_megatron.checkpoint import resume

        _after(resume, "load_checkpoint")


def main(argv: list[str]) -> int:
    from exgrpo_megatron import train

    point, rest = argv[0], argv[argv.index("--") + 1:]
    if point != "none":
        install(point)
    return train.main(rest)


if __name__ == "__main__":  # dist_checkpointing starts spawned helpers
    sys.exit(main(sys.argv[1:]))
