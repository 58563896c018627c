"""Preemption: turn SIGTERM / SIGUSR1 into a flag that every rank agrees on at a step boundary.

Usage in the trainer loop (SPMD, every rank):

    handler = PreemptionHandler().install()          # main thread, before the loop
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
from types import FrameType

import torch
import torch.distributed as dist

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL; slurm/exgrpo.sh requeues the job on this exit status
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """Records that a preemption signal arrived; `should_stop()` makes all ranks agree on it."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received_signal: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only set a flag: anything heavier is unsafe inside a signal handler.
        if self.received_signal is None:
            self.received_signal = signum
            self.received_at = time.time()

    def install(self) -> PreemptionHandler:
        """Install the handlers (must be called from the main thread); returns self."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
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
        default process group (all-reduce MAX); call it at the same point of every step on all ranks."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.received
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
