"""Start and stop torch.distributed and megatron's parallel state; seed every RNG per rank.

GPU: NCCL, one device per local rank. CPU: gloo with the CPU shims applied first. The world is
split into DP replicas of TP x PP (x CP) ranks by `megatron.core.parallel_state`, and for MoE layers
into expert groups of EP (x ETP) ranks.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from exgrpo_megatron.config.validate import ConfigError
from exgrpo_megatron.distributed import collective_watch, cpu_shims, lifetime
from exgrpo_megatron.distributed.launch_env import LaunchEnv, launch_env


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates in the TP x PP x DP grid."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    ep_rank: int = 0  # expert parallelism (MoE): which slice of the experts this rank holds
    ep_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int, rank_offset: int = 0) -> None:
    """Seed python, numpy and torch (CPU and CUDA) identically on every rank of one model replica
    unless `rank_offset` differs; megatron's model-parallel RNG tracker is seeded separately."""
    s = seed + rank_offset
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(s)


def init_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    seed: int = 1234,
    env: LaunchEnv | None = None,
    timeout_minutes: float = 30,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    collective_timeout_s: float | None = None,
    collective_ledger: bool = False,
) -> ParallelLayout:
    """Initialise the default process group and megatron's TP/PP/DP groups; idempotent. MoE models: the experts'
    own grid, PP x ETP x EP x expert-DP over the same ranks (EP taken from the dense DP x CP ranks). From here on
    every child this process forks (megatron's checkpoint writers) dies with it (distributed/lifetime.py).
    `collective_timeout_s` (parallel.collective_timeout_s): a collective that lasts longer ends the run with exit 5
    and the stacks of every stuck rank (collective_watch.py); the process groups time out PROCESS_GROUP_GRACE_S later.
    Without it the process groups wait `timeout_minutes` and nothing is watched. `collective_ledger`: the debug
    ledger of collectives (collective_ledger.py)."""
    cpu_shims.apply()
    lifetime.install_fork_hooks()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    env = env or launch_env()
    if collective_timeout_s is not None:
        timeout_minutes = (collective_timeout_s + collective_watch.PROCESS_GROUP_GRACE_S) / 60
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        if torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
            backend = "nccl"
        else:
            backend = "gloo"
        try:
            dist.init_process_group(
                backend=backend,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(minutes=timeout_minutes),
            )
        except dist.DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
            raise ConfigError([port_in_use_message(env, os.environ["MASTER_PORT"])]) from None
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            distributed_timeout_minutes=timeout_minutes,  # megatron: timedelta(minutes=...), a float is exact
        )
    if collective_timeout_s is not None:  # after megatron's import-time aliases of the collectives exist
        collective_watch.install(collective_timeout_s, dist.get_rank(), dist.get_world_size(),
                                 os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ledger=collective_ledger)
    # Same data-independent seed on all ranks of a replica; megatron forks per-TP-rank streams.
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def port_in_use_message(env: LaunchEnv, port: str) -> str:
    """The start-up refusal for a rendezvous port another process listens on (rank 0 hosts the store there)."""
    unset = ("unset MASTER_PORT (a single-process run then picks a free port)" if env.launcher == "single"
             else "set MASTER_PORT to a free port in the job script")
    return (f"MASTER_PORT: {port} on {env.master_addr} is in use by another process (EADDRINUSE), so rank 0 cannot "
            f"host the process group's store there. Find the process with `ss -ltnp 'sport = :{port}'` and stop it, "
            f"or {unset}")


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        device=device(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
    )


def destroy_distributed() -> None:
    from megatron.core import parallel_state as ps

    collective_watch.uninstall()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
