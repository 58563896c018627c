"""What a grading pool hands back: the handle a submission returns and the result it resolves to
(``reward/grader.py``'s GraderPool fills them from its dispatcher thread)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class GradeResult:
    """Per-response rewards (submission order) and what went wrong while grading them."""

    rewards: list[float]
    n_timeouts_killed: int  # items whose worker passed the hard deadline and was killed
    n_worker_deaths: int  # worker deaths while holding this batch's items (each item is retried once)
    seconds: float  # wall time from submit() to the last reward


@dataclass(eq=False)
class GradeHandle:
    """Returned by :meth:`GraderPool.submit`; pass it to :meth:`GraderPool.result`."""

    rewards: list[float]
    remaining: int
    submitted_at: float
    n_timeouts_killed: int = 0
    n_worker_deaths: int = 0
    seconds: float = 0.0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish_item(self, index: int, reward: float) -> None:
        self.rewards[index] = reward
        self.remaining -= 1
        if self.remaining == 0:
            self.seconds = time.perf_counter() - self.submitted_at
            self.done.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.done.set()
