"""Preemption: SIGTERM / SIGUSR1 abort start-up at once, and during training become a flag that every
rank agrees on at a step boundary.

Start-up (exgrpo_megatron.train.main installs the handler before any slow import or work: this module
imports only the standard library): a signal raises PreemptedDuringStartup wherever the main thread is
(config, process groups, model, vLLM engine, checkpoint load); main() turns it -- or any error that
follows a received signal, such as a peer rank vanishing from a collective -- into REQUEUE_EXIT_CODE.
Nothing is written during start-up except atomically (run config, metrics truncation, a new
checkpoint's rename), so an abort leaves no partial state. Only the interpreter's own start (before
train.py runs) is uncovered. `finish_startup()` switches to the step-boundary mode below.

Usage in the trainer loop (SPMD, every rank):

    handler = PreemptionHandler().install()          # main thread
    handler.finish_startup()                         # before the loop
    for step in ...:
        train_one_step()
        if handler.should_stop():                    # collective: all-reduce MAX over the world
            save_checkpoint(...)
            sys.exit(REQUEUE_EXIT_CODE)

Why a collective: the signal may reach only some ranks, or reach them at different instants. Each
rank checks once per step at the same point, so all ranks stop after the same step and the save
(also collective) cannot deadlock.

Delivery: Slurm sends SIGTERM to every task at preemption/time limit (then SIGKILL after
KillWait, typically 30 s); `#SBATCH --signal=USR1@300` (no `B:`) sends SIGUSR1 to every task 300 s
before the time limit, which leaves time for a save. torchrun forwards SIGTERM to its workers. The
signal also reaches helper processes; the checkpoint writer's helper is made immune to it
(model_state.ensure_signal_proof_save_workers), so the preemption save itself works.

REQUEUE_EXIT_CODE = 75 is EX_TEMPFAIL from sysexits.h ("temporary failure; the user is invited to
retry"). `slurm/exgrpo.sh` checks the training command's exit status and runs
`scontrol requeue $SLURM_JOB_ID` when it is 75; any other non-zero status is a real failure and is not
requeued. The resumed job finds the checkpoint with `checkpoint.resume=auto`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL; slurm/exgrpo.sh requeues the job on this exit status
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None  # what signal.signal returns


class PreemptedDuringStartup(BaseException):
    """A preemption signal arrived before the training loop started. A BaseException, so that no
    `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"preempted during start-up by {signal.Signals(signum).name}")


class PreemptionHandler:
    """Records that a preemption signal arrived; `should_stop()` makes all ranks agree on it. In start-up
    mode (`install(startup=True)` until `finish_startup()`) the signal also raises PreemptedDuringStartup."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received_signal: int | None = None
        self.received_at: float | None = None
        self.startup = False
        self.interrupted_startup = False  # a signal arrived in start-up mode
        self.stop_signal: int | None = None  # the signal some rank received, once should_stop() said True
        self._previous: dict[int, SignalHandler] = {}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Set a flag (anything heavier is unsafe inside a signal handler); in start-up mode also abort.
        if self.received_signal is None:
            self.received_signal = signum
            self.received_at = time.time()
        if self.startup:
            self.startup = False  # raise once; clean-up code on the way out is not interrupted again
            self.interrupted_startup = True
            raise PreemptedDuringStartup(signum)

    def install(self, startup: bool = False) -> PreemptionHandler:
        """Install the handlers (must be called from the main thread); returns self."""
        self.startup = startup
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def finish_startup(self) -> PreemptionHandler:
        """Leave start-up mode: from now on a signal only sets the flag, read at step boundaries. A signal
        that arrived during start-up (already raised) stays recorded."""
        self.startup = False
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    @property
    def received(self) -> bool:
        """This rank's own flag (no communication)."""
        return self.received_signal is not None

    def should_stop(self) -> bool:
        """True on every rank iff any rank has received a preemption signal. Collective over the
        default process group (all-reduce MAX of the signal number, kept as `stop_signal`); call it at the same
        point of every step on all ranks."""
        import torch
        import torch.distributed as dist

        own = self.received_signal or 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            self.stop_signal = own or None
            return self.received
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([own], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stop_signal = int(flag.item()) or None
        return self.stop_signal is not None

    def stop_message(self, step: int, why: str = "") -> str:
        """What a run stopping for preemption says (after should_stop() and the save of `step`; 0: none saved)."""
        signum = self.stop_signal or self.received_signal
        name = signal.Signals(signum).name if signum else "a preemption signal"
        where = "this rank" if self.received_signal == signum else "another rank"
        saved = (f"saved step {step}, exiting with {REQUEUE_EXIT_CODE} to be requeued. The next launch resumes from "
                 "that checkpoint (checkpoint.resume=auto)." if step > 0 else
                 f"no step finished, nothing saved; exiting with {REQUEUE_EXIT_CODE} to be requeued.")
        return f"exgrpo-train: preempted: {name} received (by {where}){f': {why}' if why else ''}; {saved}"
