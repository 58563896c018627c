"""A collective that does not finish in time ends the run, with every stuck rank's stacks in the log (exit 5).

`install()` (from `runtime.init_distributed`, once per process) replaces torch.distributed's collectives (all_reduce,
all_gather*, all_to_all*, broadcast*, barrier, reduce*, gather*, scatter*) by wrappers that note which collective
this thread is in and since when, and rebinds the aliases megatron-core took of them at import time. A watchdog
thread looks every half second:

* a collective in flight for `parallel.collective_timeout_s` (one collective's wait, not the step's length: a long
  step whose ranks keep meeting never fires): the rank announces it in the process group's store (`abort`), prints a
  header naming itself and the collective (op, process group, ranks, the exgrpo_megatron call site), the stacks of
  all its threads, and exits EXIT_COLLECTIVE_FAILED (5);
* a collective in flight for a second or more while another rank has announced a stop: this rank prints the same
  (the peer's reason included) and exits 5 too, so each rank stuck in a collective leaves its stacks;
* the debug ledger (`parallel.collective_ledger`, collective_ledger.py) gets its look after a short wait; the run
  loop calls `begin_step` and `check_step` (the ledger's step-boundary comparison) around each step.

Before exiting a rank waits (at most `grace_s`) until every rank has said in the store that it printed, so that
rank 0, which hosts the store, does not take it away from the others. The exit is `os._exit`: helper processes die
with the trainer (lifetime.py), the run lock is released by the kernel (run_lock.py). The process groups' own
timeout (runtime.py) is this one plus PROCESS_GROUP_GRACE_S, a backstop: on NCCL a collective returns before it
completes, and a hang in one surfaces in NCCL's own watchdog, which aborts the process (the faulthandler that
`install` enables prints every thread's stack on that abort). Point-to-point sends (pipeline stages) and
asynchronous waits are not watched here; the process-group timeout bounds them.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch.distributed as dist

from exgrpo_megatron.distributed.collective_ledger import CollectiveLedger, LedgerCall, describe_group

EXIT_COLLECTIVE_FAILED = 5  # a collective timed out, or the ledger found ranks issuing different collectives
PROCESS_GROUP_GRACE_S = 60.0  # the process groups' timeout is the watchdog's plus this (runtime.py)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object",
               "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "barrier", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "gather", "gather_object",
               "scatter", "scatter_object_list")
PEER_CHECK_S = 1.0  # a collective this old looks in the store for a peer's stop


@dataclass
class InFlight:
    """One collective this process is inside."""

    op: str
    group: Any  # the ProcessGroup (None: the default one)
    started: float  # time.monotonic()
    call: LedgerCall | None  # the ledger's record of it (ledger on)


def thread_stacks() -> str:
    """Every other thread of this process with its Python stack (innermost call last)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        parts.append(f"  thread {names.get(ident, ident)}:\n" + "".join(
            "    " + line for line in traceback.format_stack(frame)))
    return "\n".join(parts)


class CollectiveWatch:
    """The wrappers and the watchdog of one process (see the module doc)."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, store: dist.Store | None,
                 ledger: CollectiveLedger | None = None, poll_s: float = 0.5, grace_s: float = 10.0) -> None:
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.store, self.ledger = store, ledger
        self.poll_s, self.grace_s = poll_s, min(grace_s, timeout_s)
        self.in_flight: dict[int, InFlight] = {}  # thread ident -> the collective it is in
        self.stopping = threading.Event()
        self._closed = threading.Event()
        self._patched: list[tuple[ModuleType, str, Callable]] = []
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the wrappers
    def wrap(self, op: str, fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters)
        group_at = params.index("group") if "group" in params else None

        @functools.wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> Any:
            me = threading.get_ident()
            if me in self.in_flight:  # a collective inside one of ours: the outer one is watched
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            if group is None and group_at is not None and len(args) > group_at:
                group = args[group_at]
            call = self.ledger.record(op, group) if self.ledger is not None else None
            self.in_flight[me] = InFlight(op, group, time.monotonic(), call)
            try:
                return fn(*args, **kwargs)
            except BaseException:
                if self.stopping.is_set():  # a peer left because this run is stopping: the watchdog exits
                    while True:
                        time.sleep(1.0)
                raise
            finally:
                done = self.in_flight.pop(me, None)
                if done is not None and self.ledger is not None:
                    self.ledger.call_finished(self.store)

        return collective

    def install(self) -> CollectiveWatch:
        originals = {op: getattr(dist, op) for op in COLLECTIVES if hasattr(dist, op)}
        wrapped = {id(fn): self.wrap(op, fn) for op, fn in originals.items()}
        for module in [dist, *_modules_holding_aliases()]:
            for attr, value in list(vars(module).items()):
                if callable(value) and id(value) in wrapped:
                    self._patched.append((module, attr, value))
                    setattr(module, attr, wrapped[id(value)])
        try:  # NCCL's watchdog aborts a hung process: the fault handler prints every thread's stack then
            faulthandler.enable(file=sys.stderr, all_threads=True)
        except (OSError, ValueError):  # a stderr without a file descriptor (captured)
            pass
        self._thread = threading.Thread(target=self._watch, name="collective-watchdog", daemon=True)
        self._thread.start()
        return self

    def uninstall(self) -> None:
        self._closed.set()
        for module, attr, original in reversed(self._patched):
            setattr(module, attr, original)
        self._patched.clear()

    # ------------------------------------------------------------------ the watchdog
    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            try:
                self.look()
            except Exception as exc:  # noqa: BLE001 - the watchdog must not die of a store hiccup
                print(f"exgrpo-train: rank {self.rank}: collective watchdog: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)

    def oldest(self) -> InFlight | None:
        flights = list(self.in_flight.values())
        return min(flights, key=lambda f: f.started) if flights else None

    def look(self) -> None:
        """One look (the watchdog's loop body): stop the run when the oldest collective is too old, a peer stopped
        it, or the ledger names a divergence."""
        flight = self.oldest()
        if flight is None:
            return
        age = time.monotonic() - flight.started
        if age >= self.timeout_s:
            self.stop_run(f"rank {self.rank}: {self.describe(flight)} has not finished after {age:.1f} s "
                          f"(parallel.collective_timeout_s={self.timeout_s:g})", flight)
        if self.store is None or age < PEER_CHECK_S:
            return
        if self.store.check(["abort"]):
            peer = self.store.get("abort").decode().splitlines()
            self.stop_run(f"rank {self.rank}: stopping in {self.describe(flight)} ({age:.1f} s in it) because "
                          f"{peer[0]}", flight, peer[1:])
        if self.ledger is not None:
            found = self.ledger.look_while_blocked(self.store, age)
            if found:
                self.stop_run(found[0], flight, found[1:])

    def describe(self, flight: InFlight) -> str:
        where = f" from {flight.call.where()}" if flight.call is not None else ""
        return f"collective {flight.op} on {describe_group(flight.group)}{where}"

    def stop_run(self, reason: str, flight: InFlight | None, details: Sequence[str] = ()) -> None:
        """Announce the stop, print the reason, the ledger's findings and this rank's stacks, wait for the other
        ranks to print theirs (at most grace_s), exit EXIT_COLLECTIVE_FAILED."""
        self.stopping.set()
        try:
            if self.store is not None:
                self.store.compare_set("abort", "", "\n".join([reason, *details]))  # the first rank's stays
            lines = [f"exgrpo-train: {reason}; stopping the run with exit status {EXIT_COLLECTIVE_FAILED}.",
                     *details]
            if flight is not None and flight.call is not None and not details and self.ledger is not None:
                lines += self.ledger.recent(flight.call)
            lines.append(f"exgrpo-train: rank {self.rank}: the stacks of its threads:\n{thread_stacks()}")
            sys.stderr.write("\n".join(lines) + "\n")
            sys.stderr.flush()
            sys.stdout.flush()
            if self.store is not None:
                self.store.set(f"reported/{self.rank}", json.dumps(reason))
                keys = [f"reported/{r}" for r in range(self.world_size)]
                deadline = time.monotonic() + self.grace_s
                while time.monotonic() < deadline and not self.store.check(keys):
                    time.sleep(0.1)
                if self.rank == 0:  # it hosts the store: the others' last look at it comes first
                    time.sleep(1.0)
        except Exception as exc:  # noqa: BLE001 - the store's host (rank 0) may be gone already
            print(f"exgrpo-train: rank {self.rank}: ({type(exc).__name__} from the store while stopping)",
                  file=sys.stderr, flush=True)
        finally:
            os._exit(EXIT_COLLECTIVE_FAILED)


def _modules_holding_aliases() -> list[ModuleType]:
    """megatron-core and exgrpo_megatron modules already imported (megatron keeps e.g. `dist_all_gather_func =
    torch.distributed.all_gather_into_tensor`)."""
    return [m for name, m in list(sys.modules.items())
            if m is not None and name.split(".")[0] in ("megatron", "exgrpo_megatron")]


_active: CollectiveWatch | None = None


def active() -> CollectiveWatch | None:
    return _active


def store_client(master_addr: str, master_port: int, timeout_s: float) -> dist.Store:
    """A client of the process group's store (rank 0 hosts it at MASTER_ADDR:MASTER_PORT), under a prefix of ours."""
    client = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore("exgrpo_collectives", client)


def install(timeout_s: float, rank: int, world_size: int, master_addr: str, master_port: int,
            ledger: bool = False) -> CollectiveWatch:
    """Watch this process's collectives (idempotent: a second call returns the first watch)."""
    global _active
    if _active is not None:
        return _active
    store = store_client(master_addr, master_port, timeout_s) if world_size > 1 else None
    book = CollectiveLedger(rank, world_size) if ledger else None
    _active = CollectiveWatch(timeout_s, rank, world_size, store, book).install()
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.uninstall()
        _active = None


def check_step(step: int) -> None:
    """The run loop's step-boundary comparison (nothing when the ledger is off). Stops the run on a divergence."""
    watch = active()
    if watch is None or watch.ledger is None or watch.store is None:
        return
    ledger, me = watch.ledger, threading.get_ident()
    ledger.blocked = -1
    flight = InFlight("end-of-step ledger check", None, time.monotonic(), None)
    watch.in_flight[me] = flight
    try:
        found = ledger.check_step(watch.store, step)
    finally:
        watch.in_flight.pop(me, None)
        ledger.call_finished(watch.store)
    if found:
        watch.stop_run(found[0], flight, found[1:])


def begin_step(step: int) -> None:
    watch = active()
    if watch is not None and watch.ledger is not None:
        watch.ledger.begin_step(step)
