"""Console progress (a tqdm bar on a terminal, whole lines in a log file) and step-phase timers.

The progress shows the step, the time left (from the rate over the steps of *this* process, so a resumed run's
estimate is right), and the first present key of each of :data:`REWARD_KEYS`, :data:`PASS_RATE_KEYS`,
:data:`POOL_SIZE_KEYS`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

REWARD_KEYS: tuple[str, ...] = ("reward/mean", "reward")
PASS_RATE_KEYS: tuple[str, ...] = ("reward/pass_at_k", "batch/solved")
POOL_SIZE_KEYS: tuple[str, ...] = ("experience/questions",)


def _first(metrics: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((metrics[k] for k in keys if metrics.get(k) is not None), None)


def progress_postfix(metrics: Mapping[str, Any]) -> dict[str, str]:
    """The short fields shown after the bar: reward, pass rate, pool size (those present)."""
    fields: dict[str, str] = {}
    for label, keys, fmt in (("reward", REWARD_KEYS, "{:.3f}"), ("pass", PASS_RATE_KEYS, "{:.3f}"),
                             ("pool", POOL_SIZE_KEYS, "{:.0f}")):
        value = _first(metrics, keys)
        if value is not None:
            fields[label] = fmt.format(float(value))
    return fields


class ProgressBar:
    """Progress over training steps ``start_step .. total_steps`` (no-op when ``enabled`` is False).

    On a terminal, a tqdm bar redrawn in place. Anywhere else (a log file, a pipe: ``file.isatty()`` False),
    whole lines, so a log reads top to bottom: the first update, then at most one line per ``mininterval``
    seconds (default 10), and the last step's line once. :meth:`write` prints a message on a line of its own
    in both modes (above the bar on a terminal)."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True,
                 file: TextIO | None = None, mininterval: float | None = None) -> None:
        self._bar: Any = None
        self._postfix: dict[str, str] = {}
        self._file: TextIO = file if file is not None else sys.stderr
        self._enabled = enabled
        self._total, self._start, self._n = total_steps, start_step, start_step
        self._t0 = time.monotonic()
        self._printed: tuple[int, float] | None = None  # (step, time) of the last line written in line mode
        self._tty = bool(getattr(self._file, "isatty", lambda: False)())
        self._interval = mininterval if mininterval is not None else (0.5 if self._tty else 10.0)
        if enabled and self._tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=self._file, desc="train", mininterval=self._interval)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move to ``step`` (steps done) and show the metrics' reward / pass rate / pool size (a field
        absent from ``metrics`` keeps its last value)."""
        if not self._enabled:
            return
        if metrics:
            self._postfix.update(progress_postfix(metrics))
        self._n = step
        if self._bar is not None:
            self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        now = time.monotonic()
        if self._printed is None or step >= self._total or now - self._printed[1] >= self._interval:
            self._write_line(now)

    def write(self, message: str) -> None:
        """``message`` on a line of its own (the bar, on a terminal, is redrawn below it)."""
        if self._bar is not None:
            self._bar.write(message, file=self._file)
        else:
            print(message, file=self._file, flush=True)

    def line(self, now: float | None = None) -> str:
        """The line-mode text: step, share done, time per step of this process and what remains, postfix."""
        from tqdm import tqdm

        elapsed = (now if now is not None else time.monotonic()) - self._t0
        done = self._n - self._start
        pct = 100.0 * self._n / self._total if self._total else 100.0
        text = f"train: step {self._n}/{self._total} ({pct:.0f}%), elapsed {tqdm.format_interval(elapsed)}"
        if done > 0:
            remaining = elapsed / done * max(self._total - self._n, 0)
            text += f", {elapsed / done:.2f} s/step, remaining {tqdm.format_interval(remaining)}"
        if self._postfix:
            text += "; " + ", ".join(f"{k}={v}" for k, v in self._postfix.items())
        return text

    def _write_line(self, now: float) -> None:
        print(self.line(now), file=self._file, flush=True)
        self._printed = (self._n, now)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._enabled and self._printed is not None and self._printed[0] != self._n:
            self._write_line(time.monotonic())  # the last step reached, once (a stop before total_steps)
        self._enabled = False


class StepTimer:
    """Wall-clock time of named phases, reported as ``time/<name>`` seconds (accumulated if repeated).

        timer = StepTimer()
        with timer("generate"):
            ...
        metrics.update(timer.pop_metrics())

    ``synchronize`` (e.g. ``torch.cuda.synchronize``) is called at both ends of a phase so that asynchronous
    device work is attributed to the phase that launched it.
    """

    def __init__(self, synchronize: Any = None) -> None:
        self._synchronize = synchronize
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self._synchronize is not None:
            self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._synchronize is not None:
                self._synchronize()
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}": seconds for name, seconds in self._seconds.items()}

    def pop_metrics(self) -> dict[str, float]:
        """The ``time/*`` metrics so far, then reset (call once per step)."""
        out = self.metrics()
        self._seconds.clear()
        return out
