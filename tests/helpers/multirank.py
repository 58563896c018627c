"""Run a function on N spawned gloo ranks and collect each rank's return value.

    results = run_on_ranks(my_fn, world_size=2, args=(tp, pp))   # list, index = rank

`my_fn` must be importable (module-level in a test module). Each rank gets RANK/WORLD_SIZE/
MASTER_* in its environment, one intra-op thread, and tears down megatron's parallel state and the
process group on exit. An exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, queue) -> None:
    from tests.helpers.rank_processes import rank_env

    os.environ.update(rank_env(rank, world_size, port))
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # megatron's apex/TE fallback notices, once per rank
    torch.set_num_threads(1)
    try:
        result = fn(*args, **kwargs)
        # Pickled by value: tensors must not travel as shared-memory handles that die with the child.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        from exgrpo_megatron.distributed.runtime import destroy_distributed

        try:
            destroy_distributed()
        except Exception:  # noqa: BLE001
            pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 600.0,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs or {}, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
