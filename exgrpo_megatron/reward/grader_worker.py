"""The grading worker process of :class:`~exgrpo_megatron.reward.grader.GraderPool`, its shared progress
record, and how queued items are cut into chunks (:func:`take_chunk`).

A worker receives chunks of ``(answer, gold)`` items over its pipe and grades them one at a time, in order,
on its main thread (Math-Verify's ``signal.alarm`` timeouts need that). After each item it writes into a
small shared-memory record that the parent reads without any message:

    record[DONE]        items graded since the worker started (a counter)
    record[LAST_DONE]   time.monotonic() when the last one finished (system-wide clock)
    record[SLOTS + n % RING]   the reward of the worker's n-th item (0-based)

and after each chunk it sends one ``("done", count)`` message. So the parent is woken once per chunk, not
once per item, yet it still sees per-item progress (for the hard deadline) and, after killing a worker,
knows exactly which items it finished (their rewards are in the ring) and which one it was stuck on.
The parent reads rewards only after a ``done`` message or after the worker has died, so every write it
reads has happened before a pipe system call or the worker's exit.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from exgrpo_megatron.reward.scoring import score_answer, warm_up_math_verify

DONE, LAST_DONE, SLOTS = 0, 1, 2
PIPELINE_DEPTH = 2  # chunks in flight per worker: the one being graded + the next
MAX_CHUNK = 16  # items per chunk (~30 ms of ordinary grading)
RING = PIPELINE_DEPTH * MAX_CHUNK  # reward slots per worker: covers every item it can hold
PIPELINE_MAX_CHARS = 16_000  # a queued-behind chunk must be small, so a send to a busy worker never blocks


def record_size(ring: int) -> int:
    """Length of the shared ``double`` array for a ring of ``ring`` reward slots."""
    return SLOTS + ring


def take_chunk(queue: collections.deque, n_ready: int, busy_chars: int | None) -> list:
    """Pop the next chunk off ``queue`` (jobs ``(handle, index, answer, gold, ...)``), in order.

    About ``ceil(len(queue) / (n_ready x PIPELINE_DEPTH))`` jobs, 1 to ``MAX_CHUNK``, so a batch's tail
    still spreads over every worker; past that target a run of jobs with the same gold is finished (a
    GRPO group shares one gold, which a worker parses once). ``busy_chars``: characters already in the
    pipe of a busy worker, whose chunk must keep the total <= ``PIPELINE_MAX_CHARS``; None for an idle
    worker, which always gets at least one job.
    """
    target = min(MAX_CHUNK, max(1, math.ceil(len(queue) / (max(1, n_ready) * PIPELINE_DEPTH))))
    chunk: list = []
    chars = busy_chars or 0
    while queue and len(chunk) < MAX_CHUNK:
        job = queue[0]
        if len(chunk) >= target and job[3] != chunk[-1][3]:
            break
        size = len(job[2]) + len(job[3])
        if (chunk or busy_chars is not None) and chars + size > PIPELINE_MAX_CHARS:
            break
        chunk.append(queue.popleft())
        chars += size
    return chunk


def ignore_preemption_signals() -> None:
    """Slurm sends SIGTERM/SIGUSR1 to every process of a job step; the trainer handles them (finish the
    step, save, exit 75). The fork server and workers must survive them, or the step in flight dies with
    a broken pool; they exit on their own when the trainer closes their pipes. Ctrl-C is the trainer's too."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def worker_main(conn: Connection, timeout_seconds: int, record: Any, ring: int) -> None:
    """Worker loop: receive a list of ``(answer, gold)``, grade it into ``record``, send ``("done", count)``;
    ``None`` or EOF stops it."""
    ignore_preemption_signals()
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    done = 0
    try:
        warm_up_math_verify(timeout_seconds)  # ~ms when forked from the warm fork server
        conn.send(("ready", os.getpid()))
        while True:
            chunk = conn.recv()
            if chunk is None:
                return
            for answer, gold in chunk:
                record[SLOTS + done % ring] = score_answer(answer, gold, timeout_seconds)
                done += 1
                record[LAST_DONE] = time.monotonic()
                record[DONE] = done
            conn.send(("done", done))
    except (EOFError, OSError):
        return  # the parent went away
