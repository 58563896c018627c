"""trainer.train_threads: how many threads the policy's passes get, that the count is restored after them, and that the
loss and gradients do not depend on it."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import all_errors
from exgrpo_megatron.distributed.threads import (
    ranks_on_this_node,
    resolve_train_threads,
    torch_threads,
    train_threads_from_env,
)


@pytest.mark.parametrize(("configured", "cores", "local_ranks", "expected"), [
    (0, 2, 1, 2),    # the demo: one rank, both cores
    (0, 16, 8, 2),   # 8 ranks per node share 16 cores
    (0, 16, 3, 5),   # floor
    (0, 2, 4, 1),    # more ranks than cores: never 0
    (3, 2, 1, 3),    # explicit value as given
    (1, 64, 1, 1),
])
def test_resolution(configured, cores, local_ranks, expected):
    assert resolve_train_threads(configured, cores, local_ranks) == expected


def test_negative_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="trainer.train_threads"):
        resolve_train_threads(-1, 2, 1)
    errors = all_errors(load_config("demo_cpu", ["trainer.train_threads=-2"]), 1, check_paths=False)
    assert any(e.startswith("trainer.train_threads") for e in errors), errors


@pytest.mark.parametrize(("env", "world", "expected"), [
    ({"LOCAL_WORLD_SIZE": "4"}, 16, 4),                      # torchrun
    ({"SLURM_NTASKS_PER_NODE": "8"}, 16, 8),                 # srun
    ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 8, 4),              # srun, 4 on each of 2 nodes
    ({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}, 16, 2),
    ({}, 3, 3),                                              # unknown: assume all ranks on this host
    ({}, 1, 1),
    ({"LOCAL_WORLD_SIZE": ""}, 2, 2),
])
def test_ranks_on_this_node(env, world, expected):
    assert ranks_on_this_node(env, world) == expected


def test_env_resolution_divides_this_process_cores(monkeypatch):
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert train_threads_from_env(0, 1) == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert train_threads_from_env(0, cores) == 1


def test_thread_count_is_set_inside_and_restored_after():
    before = torch.get_num_threads()
    target = before + 1
    with torch_threads(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), torch_threads(target):
        assert torch.get_num_threads() == target
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before  # restored on error too
    with torch_threads(before):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def _one_and_two_threads() -> dict:
    from tests.test_sequence_packing import PACKED, _policy_run

    out = {}
    for n in (1, 2):
        with torch_threads(n):
            out[n] = _policy_run(1, 1, PACKED) | {"threads": torch.get_num_threads()}
    return out


def test_two_threads_give_the_one_thread_loss_and_gradients():
    """The switch changes only how many cores the kernels use: Policy.forward_backward (packed, fused output layer)
    on 2 threads has the 1-thread loss and every gradient, to fp32 summation order."""
    from tests.helpers.multirank import run_on_ranks
    from tests.test_sequence_packing import _compare

    (res,) = run_on_ranks(_one_and_two_threads, world_size=1)
    assert (res[1]["threads"], res[2]["threads"]) == (1, 2)
    _compare(res[1], res[2])
