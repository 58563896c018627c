"""Intra-op threads of the policy's forward/backward (trainer.train_threads).

Generation overlaps grading (the grader pool's processes run Math-Verify while the engine decodes), so the
process keeps OMP_NUM_THREADS (1 under `make`) there. The policy's forward/backward passes (trajectory
scoring, old log-probs, the updates) run after the step's grades are collected, when the grader pool is idle:
they get this rank's share of the node's cores, torch.set_num_threads around each pass, restored afterwards.

    auto (0): cores this process may run on (os.sched_getaffinity) // ranks on this node, at least 1.
Ranks on this node: LOCAL_WORLD_SIZE (torchrun), else SLURM_NTASKS_PER_NODE (srun), else the world size
(all ranks on one host: never more threads than cores).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity; cpu_count where affinity is not available)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def ranks_on_this_node(env: Mapping[str, str], world_size: int) -> int:
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key, "")
        digits = value.split("(")[0].split(",")[0]  # Slurm writes e.g. "4(x2)" for 4 tasks on each of 2 nodes
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    return max(int(world_size), 1)


def resolve_train_threads(configured: int, cores: int, local_ranks: int) -> int:
    """trainer.train_threads: a positive value as given; 0 (auto) = cores // local ranks, at least 1."""
    if configured < 0:
        raise ValueError(f"trainer.train_threads: must be >= 0 (0 = auto), got {configured}")
    if configured > 0:
        return configured
    return max(1, cores // max(local_ranks, 1))


def train_threads_from_env(configured: int, world_size: int) -> int:
    return resolve_train_threads(configured, available_cores(), ranks_on_this_node(os.environ, world_size))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count is `n` inside the block and what it was before after it (also on error)."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
