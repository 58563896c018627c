"""Math-Verify grading in a pool of killable worker processes.

Failure it survives: Math-Verify's own ``signal.alarm`` timeouts fire only between Python bytecodes
on a process's main thread, so a pathological answer stuck in C code, a crashed worker or a stopped
one would stall a plain ``multiprocessing.Pool`` (which cannot kill one task) and with it training.
Here every worker is a separate process that grades items one at a time, in order, on its main
thread (so the alarm works; ``reward/grader_worker.py``). A dispatcher thread in the parent sends
consecutive items in chunks (``take_chunk``: up to 16, a gold's items kept together) and keeps up to
``PIPELINE_DEPTH`` chunks in each worker's pipe (the one being graded plus the next, so a worker never
idles waiting for the parent on a loaded machine); grading overlaps whatever the caller does next
(generation). Workers report progress per item through shared memory and send one message per
chunk, so the parent wakes once per chunk.

A worker that makes no progress for ``hard_deadline_seconds`` while it holds items is killed
(``n_timeouts_killed``); a worker that dies is noticed through its process sentinel
(``n_worker_deaths``). A fresh worker replaces it while the others keep going: the items it finished
keep their rewards, the one it was grading (its oldest unfinished) is settled, and the items queued
behind it go back to the shared queue. That item scores 0 after a deadline kill; after a death it is
retried once (the worker may have been killed from outside before reading it) and scores 0 if its
second worker dies too. So one slow item delays at most the items queued behind it on its worker (at
most ``PIPELINE_DEPTH`` chunks), by at most the deadline. Results keep the order of the submitted items.

The cheap format check (``extract_answer``) runs in the parent; only ``(answer, gold)`` travels to
a worker. Workers come from a ``forkserver`` that has imported and warmed up Math-Verify once
(``reward/worker_warmup.py``), so a replacement starts in milliseconds (``start_method="spawn"``
also works, at about a second per start).
"""

from __future__ import annotations

import atexit
import collections
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

from exgrpo_megatron.reward.grade_handle import GradeHandle, GradeResult
from exgrpo_megatron.reward.grader_worker import (
    DONE,
    LAST_DONE,
    PIPELINE_DEPTH,
    RING,
    SLOTS,
    record_size,
    take_chunk,
    worker_main,
)
from exgrpo_megatron.reward.scoring import extract_answer, score_response, validate_timeout

__all__ = ["GradeHandle", "GradeResult", "GraderPool", "score_response", "validate_timeout"]

GradeItem = tuple[str, str, bool]  # (response_text, gold, require_think)

_STARTUP_DEADLINE_SECONDS = 120.0  # a worker that never reports ready is killed after this
_MAX_CONSECUTIVE_START_FAILURES = 5  # then the pool is declared broken (e.g. Math-Verify not importable)
_MAX_RETRIES_AFTER_DEATH = 1  # an item whose worker died is retried once; a second death scores it 0
_Job = tuple["GradeHandle", int, str, str, int]  # (handle, index in batch, answer, gold, worker deaths it saw)


@dataclass(eq=False)
class _Worker:
    process: Any  # multiprocessing Process of the chosen context
    conn: Connection
    record: Any  # shared progress record (grader_worker module doc)
    started_at: float
    ready: bool = False
    jobs: collections.deque[_Job] = field(default_factory=collections.deque)  # sent, not yet collected
    chunks: int = 0  # chunks sent and not yet reported done
    collected: int = 0  # items whose rewards were taken from the record (= the worker's count when idle)
    progress_seen: int = 0  # the worker's count when its deadline was last set
    inflight_chars: int = 0
    deadline: float = float("inf")  # last progress + hard deadline, while it holds jobs


def grader_forkserver_context() -> ForkServerContext:
    """The process-wide fork server every grading pool uses (GraderPool, reward/benchmark_grading.py). Its preload
    imports Math-Verify once and makes the server ignore Slurm's job-wide SIGTERM/SIGUSR1 (grader_worker). The
    server is started by whichever pool comes first and the preload is a no-op afterwards, so every pool must
    ask for it through here: one started without it would hand out workers that die on preemption signals."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["exgrpo_megatron.reward.grader_worker", "exgrpo_megatron.reward.worker_warmup"])
    return ctx


class GraderPool:
    """A pool of ``num_workers`` Math-Verify processes with per-item hard deadlines (see module doc)."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_seconds: int = 5,
        hard_deadline_seconds: float = 30.0,
        start_method: str = "forkserver",
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"GraderPool: num_workers must be an int >= 1, got {num_workers!r}")
        if not hard_deadline_seconds > 0:
            raise ValueError(f"GraderPool: hard_deadline_seconds must be > 0, got {hard_deadline_seconds!r}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"GraderPool: start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.timeout_seconds = validate_timeout(timeout_seconds)
        self.hard_deadline_seconds = float(hard_deadline_seconds)
        self.num_workers = num_workers
        self._ctx: ForkServerContext | SpawnContext = (
            grader_forkserver_context() if start_method == "forkserver" else mp.get_context("spawn"))
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._wake_recv, self._wake_send = mp.Pipe(duplex=False)
        self._closing = False
        self._broken: str | None = None
        self._consecutive_start_failures = 0
        self.total_timeouts_killed = 0  # over the pool's life, idle deaths included
        self.total_worker_deaths = 0
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._dispatch_loop, name="GraderPool-dispatch", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # before multiprocessing's own exit hook terminates the workers

    @classmethod
    def from_config(cls, reward_config: Any) -> GraderPool:
        """Build from a ``RewardConfig`` (num_workers, timeout_seconds, hard_deadline_seconds)."""
        return cls(
            num_workers=reward_config.num_workers,
            timeout_seconds=reward_config.timeout_seconds,
            hard_deadline_seconds=reward_config.hard_deadline_seconds,
        )

    # ----------------------------------------------------------------------------------- public API
    def submit(self, items: list[GradeItem]) -> GradeHandle:
        """Queue ``(response_text, gold, require_think)`` items for grading; returns at once."""
        handle = GradeHandle(rewards=[0.0] * len(items), remaining=len(items), submitted_at=time.perf_counter())
        jobs: list[_Job] = []
        for index, (response_text, gold, require_think) in enumerate(items):
            answer = extract_answer(response_text, require_think)
            if answer is None:
                handle.finish_item(index, 0.0)
            else:
                jobs.append((handle, index, answer, gold, 0))
        if not items:
            handle.done.set()
        with self._lock:
            if self._closing:
                raise RuntimeError("GraderPool.submit: the pool is closed")
            if self._broken is not None:
                raise RuntimeError(f"GraderPool.submit: the pool is broken: {self._broken}")
            self._queue.extend(jobs)
        if jobs:
            self._wake()
        return handle

    def result(self, handle: GradeHandle, timeout: float | None = None) -> GradeResult:
        """Block until every item of ``handle`` is graded (or scored 0 after a kill)."""
        if not handle.done.wait(timeout):
            raise TimeoutError(f"GraderPool.result: {handle.remaining} items still grading after {timeout} s")
        if handle.error is not None:
            raise RuntimeError(f"GraderPool: batch not graded: {handle.error}")
        return GradeResult(list(handle.rewards), handle.n_timeouts_killed, handle.n_worker_deaths, handle.seconds)

    def grade(self, items: list[GradeItem]) -> GradeResult:
        """``result(submit(items))``."""
        return self.result(self.submit(items))

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (tests kill these)."""
        with self._lock:
            return [int(w.process.pid) for w in self._workers]

    def items_graded(self) -> list[int]:
        """Items each current worker has finished since it started (its shared progress counter, read without
        a message; tests use it to act at a known point of a worker's chunk)."""
        with self._lock:
            return [int(w.record[DONE]) for w in self._workers]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until every current worker has started and imported Math-Verify (optional warm-up)."""
        end = time.monotonic() + timeout
        while not all(w.ready for w in list(self._workers)):
            if self._broken is not None:
                raise RuntimeError(f"GraderPool is broken: {self._broken}")
            if time.monotonic() > end:
                raise TimeoutError(f"GraderPool workers not ready after {timeout} s")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop the dispatcher and the workers; unfinished batches fail with RuntimeError in result()."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        atexit.unregister(self.close)
        self._wake()
        self._thread.join(timeout=10.0)
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=1.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5.0)
            worker.conn.close()
        self._fail_all("the pool was closed")
        self._wake_recv.close()
        self._wake_send.close()

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- internals
    def _wake(self) -> None:
        try:
            self._wake_send.send_bytes(b"w")
        except OSError:
            pass

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        record = self._ctx.RawArray("d", record_size(RING))
        process = self._ctx.Process(target=worker_main, args=(child_conn, self.timeout_seconds, record, RING),
                                    name="GraderPool-worker", daemon=True)
        process.start()
        child_conn.close()
        return _Worker(process=process, conn=parent_conn, record=record, started_at=time.monotonic())

    def _replace(self, worker: _Worker, killed_on_deadline: bool) -> None:
        """Kill ``worker`` (if alive), count it, keep what it finished, settle the item it was on (see
        module doc), re-queue the rest."""
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._collect(worker, int(worker.record[DONE]))  # it is gone: its record is final
        if killed_on_deadline:
            self.total_timeouts_killed += 1
        else:
            self.total_worker_deaths += 1
        if worker.jobs:
            handle, index, answer, gold, deaths_seen = worker.jobs.popleft()
            if killed_on_deadline:
                handle.n_timeouts_killed += 1
            else:
                handle.n_worker_deaths += 1
            if killed_on_deadline or deaths_seen >= _MAX_RETRIES_AFTER_DEATH:
                handle.finish_item(index, 0.0)
            else:  # it may have died before even reading the item (e.g. killed from outside): retry once
                worker.jobs.appendleft((handle, index, answer, gold, deaths_seen + 1))
            with self._lock:
                self._queue.extendleft(reversed(worker.jobs))
            worker.jobs.clear()
        self._consecutive_start_failures = 0 if worker.ready else self._consecutive_start_failures + 1
        if self._consecutive_start_failures >= _MAX_CONSECUTIVE_START_FAILURES:
            self._broken = f"{self._consecutive_start_failures} grader workers in a row died before becoming ready"
            return
        with self._lock:
            self._workers[self._workers.index(worker)] = self._start_worker()

    def _assign(self) -> None:
        """Top every ready worker up to the pipeline depth, breadth first (idle workers are served first)."""
        for depth in range(1, PIPELINE_DEPTH + 1):
            for worker in list(self._workers):
                if not worker.ready or worker.chunks >= depth or worker not in self._workers:
                    continue
                with self._lock:
                    if not self._queue:
                        return
                    n_ready = sum(w.ready for w in self._workers)
                    chunk = take_chunk(self._queue, n_ready, worker.inflight_chars if worker.jobs else None)
                if not chunk:
                    continue
                try:
                    worker.conn.send([(answer, gold) for _, _, answer, gold, _ in chunk])
                except OSError:  # died: retry the items elsewhere
                    with self._lock:
                        self._queue.extendleft(reversed(chunk))
                    self._replace(worker, killed_on_deadline=False)
                    continue
                if not worker.jobs:
                    worker.deadline = time.monotonic() + self.hard_deadline_seconds
                worker.jobs.extend(chunk)
                worker.chunks += 1
                worker.inflight_chars += sum(len(job[2]) + len(job[3]) for job in chunk)

    def _collect(self, worker: _Worker, count: int) -> None:
        """Finish the items ``worker`` graded, up to its ``count``-th, with the rewards in its record."""
        while worker.collected < count and worker.jobs:
            handle, index, answer, gold, _ = worker.jobs.popleft()
            worker.inflight_chars -= len(answer) + len(gold)
            handle.finish_item(index, float(worker.record[SLOTS + worker.collected % RING]))
            worker.collected += 1

    def _progressed(self, worker: _Worker, now: float) -> bool:
        """At ``worker``'s deadline: if it finished an item since the deadline was set, move the deadline
        to that item's finish + the hard deadline and say whether it is still ahead."""
        count = int(worker.record[DONE])
        if count <= worker.progress_seen:
            return False
        worker.progress_seen = count
        worker.deadline = worker.record[LAST_DONE] + self.hard_deadline_seconds
        return now < worker.deadline

    def _receive(self, worker: _Worker) -> None:
        try:
            kind, value = worker.conn.recv()
        except (EOFError, OSError):
            self._replace(worker, killed_on_deadline=False)
            return
        if kind == "ready":
            worker.ready = True
            self._consecutive_start_failures = 0
        elif kind == "done":
            worker.chunks -= 1
            self._collect(worker, int(value))
            worker.progress_seen = max(worker.progress_seen, worker.collected)
            worker.deadline = time.monotonic() + self.hard_deadline_seconds if worker.jobs else float("inf")

    def _drain(self, worker: _Worker) -> None:
        """Receive every message already waiting from ``worker`` (EOF retires it)."""
        while worker in self._workers and not worker.conn.closed and worker.conn.poll():
            self._receive(worker)

    def _next_wakeup(self) -> float | None:
        now = time.monotonic()
        deadlines = [w.deadline if w.ready else w.started_at + _STARTUP_DEADLINE_SECONDS for w in self._workers]
        earliest = min(deadlines, default=float("inf"))
        return None if earliest == float("inf") else max(0.0, earliest - now)

    def _dispatch_loop(self) -> None:
        try:
            while not self._closing and self._broken is None:
                self._assign()
                by_conn = {w.conn: w for w in self._workers}
                by_sentinel = {w.process.sentinel: w for w in self._workers}
                ready: list[Any] = wait([self._wake_recv, *by_conn, *by_sentinel], timeout=self._next_wakeup())
                if self._wake_recv in ready:
                    while self._wake_recv.poll():
                        self._wake_recv.recv_bytes()
                for obj in ready:  # messages first: a worker may have answered and then exited
                    worker = by_conn.get(obj)
                    if worker is not None:
                        self._drain(worker)
                for obj in ready:
                    worker = by_sentinel.get(obj)
                    if worker is not None and worker in self._workers:
                        self._drain(worker)
                        if worker in self._workers and not worker.process.is_alive():
                            self._replace(worker, killed_on_deadline=False)
                now = time.monotonic()
                for worker in list(self._workers):
                    if worker.ready and now >= worker.deadline and not self._progressed(worker, now):
                        if worker.conn.poll():  # answered just in time
                            self._receive(worker)
                            continue
                        self._replace(worker, killed_on_deadline=True)
                    elif not worker.ready and now >= worker.started_at + _STARTUP_DEADLINE_SECONDS:
                        self._replace(worker, killed_on_deadline=False)
        except Exception as exc:  # never leave callers waiting forever
            self._broken = f"dispatcher crashed: {exc!r}"
        if self._broken is not None:
            self._fail_all(self._broken)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            handles = {id(h): h for h, *_ in self._queue}
            self._queue.clear()
        handles.update({id(job[0]): job[0] for w in self._workers for job in w.jobs})
        for handle in handles.values():
            if not handle.done.is_set():
                handle.fail(message)
