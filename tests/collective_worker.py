"""Ranks that go wrong on purpose, for tests/test_collective_watch.py (each rank a real process: the run must end by
itself with the documented exit status).

    python -m tests.collective_worker hang TIMEOUT_S       # ranks block in collectives the other never enters
    python -m tests.collective_worker train STEP -- TRAIN_ARGS...   # the trainer; rank 0 runs one extra model
                                                                    # forward (pass 'planted') in step STEP
"""

from __future__ import annotations

import sys


def planted_hang(timeout_s: float) -> int:
    """Through the trainer's own init path: rank 0 all-reduces over a new group of every rank, the others over the
    default group -- each blocks in a collective no other rank enters."""
    import torch
    import torch.distributed as dist

    from exgrpo_megatron.distributed.runtime import init_distributed

    init_distributed(seed=1, collective_timeout_s=timeout_s)
    other = dist.new_group(list(range(dist.get_world_size())))
    x = torch.ones(3)
    dist.all_reduce(x)  # one collective that all ranks enter, so the watch sees a completed one first
    print(f"rank {dist.get_rank()}: entering the planted hang", flush=True)
    dist.all_reduce(x, group=other if dist.get_rank() == 0 else None)
    print("the planted hang returned", flush=True)
    return 0


def planted_forward_observers(at_step: int) -> list:
    """Rank 0 runs the policy forward on one of its rows after building the rows of step `at_step`; rank 1 does
    not (under EP a forward is a collective of the EP group)."""
    import torch.distributed as dist

    from exgrpo_megatron.distributed.collective_ledger import collective_pass
    from exgrpo_megatron.policy.train_batch import token_stats
    from exgrpo_megatron.training.step_observer import StepObserver

    class PlantedForward(StepObserver):
        def started(self, c) -> None:
            self.policy = c.policy

        def rows_built(self, step: int, rows) -> None:
            if step == at_step and dist.get_rank() == 0:
                with collective_pass("planted"):
                    token_stats(self.policy, rows.sequences[:1], rows.prompt_lengths[:1], site="planted",
                                temperature=1.0, with_entropy=False, max_tokens=4096)

    return [PlantedForward()]


def main(argv: list[str]) -> int:
    if argv[0] == "hang":
        return planted_hang(float(argv[1]))
    from exgrpo_megatron import train

    return train.main(argv[argv.index("--") + 1:], observers=planted_forward_observers(int(argv[1])))


if __name__ == "__main__":  # dist_checkpointing starts spawned helpers
    sys.exit(main(sys.argv[1:]))
