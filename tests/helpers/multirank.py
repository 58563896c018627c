"""Run a function on N spawned gloo ranks and collect each rank's return value.

    results = run_on_ranks(my_fn, world_size=2, args=(tp, pp))   # list, index = rank

`my_fn` must be importable (module-level in a test module). Each rank gets RANK/WORLD_SIZE/
MASTER_* in its environment, one intra-op thread, and tears down megatron's parallel state and the
process group on exit. An exception on any rank fails the call with that rank's traceback.

The ranks are forked from a fork server of this module's own (`RANK_SERVER`) that imported torch, megatron-core,
transformers and the trainer once: a spawned rank spends ~7 s of CPU importing them, which over the suite's
hundreds of ranks was most of `make test`'s time. A rank still starts as a spawned one would: the caller's
environment, working directory and sys.path, fresh multiprocessing state, default signal handlers (Python's own
forkserver machinery; only the server instance is ours, so the process-wide one the grader pools use keeps its
preload and signal handling).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable
from multiprocessing import context, forkserver, popen_forkserver
from typing import Any

from exgrpo_megatron.distributed.launch_env import free_local_port

# "fork_server": ranks fork from RANK_SERVER; "spawn": each rank a new interpreter, for code that relies on a process's
# normal exit (vLLM's CPU workers unlink their shared-memory segments only then: tests/vllm/conftest.py).
START_METHOD = "fork_server"
PRELOAD = ["torch", "numpy", "transformers", "megatron.core", "exgrpo_megatron.training.trainer",
           "exgrpo_megatron.evaluate", "tests.helpers.rank_processes"]
RANK_SERVER = forkserver.ForkServer()
RANK_SERVER.set_forkserver_preload(PRELOAD)


class _RankPopen(popen_forkserver.Popen):
    """Python's forkserver Popen, connecting to RANK_SERVER instead of the process-wide server."""

    def _launch(self, process_obj) -> None:
        shared = forkserver.connect_to_new_process
        forkserver.connect_to_new_process = RANK_SERVER.connect_to_new_process
        try:
            super()._launch(process_obj)
        finally:
            forkserver.connect_to_new_process = shared


class _RankProcess(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _RankPopen(process_obj)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, queue,
            environ: dict[str, str]) -> None:
    from tests.helpers.rank_processes import rank_env

    os.environ.clear()  # the caller's environment now, not the server's at its start
    os.environ.update(environ)
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
    spawn = START_METHOD == "spawn"
    ctx = mp.get_context("spawn" if spawn else "forkserver")
    process = ctx.Process if spawn else _RankProcess
    queue = ctx.Queue()
    port = free_local_port()
    environ = dict(os.environ)
    procs = [process(target=_worker, args=(r, world_size, port, fn, args, kwargs or {}, queue, environ),
                     daemon=False) for r in range(world_size)]
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
