"""`python -m exgrpo_megatron.train --config-name <preset> [hydra overrides]` (console script `exgrpo-train`).

    exgrpo-train --config-name exgrpo_7b experience.ratio=0.25 ++parallel.tensor_model_parallel_size=4
    exgrpo-train --config-name exgrpo_7b --dry-run --world-size 16     # validate + print the plan, no model
    exgrpo-train --config-name exgrpo_7b --dry-run --world-size 16 --phase-times runs/exgrpo_7b-1234

Every rank runs this same entry point (torchrun or srun). The preemption handler is installed first
(before any slow import): SIGTERM / SIGUSR1 at any moment of start-up exits REQUEUE_EXIT_CODE (75). The
config is composed and validated (values and the paths the run reads; a dry run plans from the values alone
and only lists the path problems) before any process group exists;
an invalid config exits with status 2 and `key: value: reason` lines, as does a data set left without
usable rows, a run directory that is unusable or held by another trainer (distributed/run_lock.py), and a
resume whose checkpoint does not fit the config (config/resume_changes.py, checkpoint/compat.py); such a refusal
removes the run directory it created. A dry run exits 3 when its memory plan does not fit one GPU
(planning/memory_plan.py), and a run on a GPU whose plan exceeds the card exits 2 before building anything. A
collective that waits longer than `parallel.collective_timeout_s`, or ranks that the debug ledger finds issuing
different collectives, end the run with status 5 and each stuck rank's stacks (distributed/collective_watch.py). A
rank whose peer process died mid-run exits 1 with one line saying so (distributed/lost_peer.py), not gloo's
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from exgrpo_megatron.distributed.launch_env import launch_env
from exgrpo_megatron.distributed.lost_peer import lost_peer_message
from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE, PreemptedDuringStartup, PreemptionHandler

if TYPE_CHECKING:
    from exgrpo_megatron.algo.protocol import RLAlgorithm
    from exgrpo_megatron.config.schema import RootConfig
    from exgrpo_megatron.training.step_observer import StepObserver

EXIT_INVALID_CONFIG = 2
EXIT_PLAN_DOES_NOT_FIT = 3  # the dry run: the memory plan exceeds one GPU (planning/memory_plan.py)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="exgrpo-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default="demo_cpu", help="preset in conf/ (without .yaml)")
    parser.add_argument("--config-dir", "-cd", default=None, help="config directory (default: the repo's conf/)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the values and print the plan; build nothing, read no model or data (paths "
                             "that a run would stop on are listed; exit 0, or 3 when the memory plan does not fit "
                             "one GPU)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="dry run: the memory of one target GPU in GiB (default: this machine's first GPU, "
                             "else 80, the paper's H100 80GB)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="world size to validate against (default: from torchrun/Slurm, else 1)")
    parser.add_argument("--phase-times", metavar="RUN_DIR", default=None,
                        help="dry run: the generate/train seconds of the generation-ahead plan from this run's "
                             "metrics.jsonl (default: a documented ratio, planning/generation_split.py)")
    return parser.parse_known_args(argv)


def _rank_and_world() -> tuple[int, int]:
    env = launch_env()
    return env.rank, env.world_size


def main(argv: list[str] | None = None, observers: Sequence[StepObserver] = ()) -> int:
    """The entry point; `observers` receive the run's hooks (step_observer.py), as with run_training."""
    preemption = PreemptionHandler().install(startup=True)
    try:
        return _main(argv, preemption, observers)
    except BaseException as exc:
        # only start-up: a failure in training after a step-boundary stop is a real failure, not a requeue
        if not preemption.interrupted_startup or isinstance(exc, SystemExit):
            lost_peer = None if isinstance(exc, SystemExit) else lost_peer_message(exc, *_rank_and_world())
            if lost_peer is None:
                raise
            print(lost_peer, file=sys.stderr)
            return 1
        cause = "" if isinstance(exc, PreemptedDuringStartup) else f" ({type(exc).__name__}: {exc})"
        print(f"exgrpo-train: preempted during start-up by signal {preemption.received_signal}{cause}; "
              f"exiting with {REQUEUE_EXIT_CODE} to be requeued", file=sys.stderr)
        return REQUEUE_EXIT_CODE


def _main(argv: list[str] | None, preemption: PreemptionHandler, observers: Sequence[StepObserver]) -> int:
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.config.validate import ConfigError, response_store_key_errors, validate
    from exgrpo_megatron.convert.peft_adapter import peft_adapter_errors
    from exgrpo_megatron.distributed.launch_env import launch_env
    from exgrpo_megatron.planning.startup_checks import (
        memory_startup_errors,
        moe_startup_errors,
        vllm_startup_errors,
    )

    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    world_size = args.world_size or launch_env().world_size
    try:
        cfg = load_config(args.config_name, overrides, args.config_dir)
        dry_run = args.dry_run or cfg.dry_run
        validate(cfg, world_size, check_paths=not dry_run)  # a dry run plans from the preset's shape: no files read
        algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
        store_errors = response_store_key_errors(cfg.experience, cfg.algo.name,
                                                 getattr(algorithm, "experience_keys", frozenset()),
                                                 algorithm.uses_pool)
        if store_errors:
            raise ConfigError(store_errors)
        if cfg.rollout.max_staleness > 0 and algorithm.filters_groups and cfg.algo.max_refill_rounds > 0:
            raise ConfigError([f"algo.name: {cfg.algo.name} filters groups and refills the batch, which needs the "
                               "step's own rewards before generating more; not with rollout.max_staleness > 0"])
    except ConfigError as exc:
        print(f"exgrpo-train: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    if dry_run:
        from exgrpo_megatron.config.domains import path_errors
        from exgrpo_megatron.logging.startup import replay_summary
        from exgrpo_megatron.planning.dry_run import dry_run_report
        from exgrpo_megatron.planning.generation_split import read_phase_times
        from exgrpo_megatron.planning.startup_checks import gpu_memory_gib

        try:
            times = read_phase_times(args.phase_times) if args.phase_times else None
        except ValueError as exc:
            print(f"exgrpo-train: {exc}", file=sys.stderr)
            return EXIT_INVALID_CONFIG
        gpu_gib = args.gpu_memory_gib or gpu_memory_gib()
        report = dry_run_report(cfg, world_size, replay_summary(cfg, algorithm), phase_times=times,
                                gpu_memory_gib=gpu_gib)
        print(report.text)
        for line in path_errors(cfg):  # not needed for the plan; a real run would stop on them (exit 2)
            print(f"exgrpo-train: dry run: a run would exit 2 on {line}", file=sys.stderr)
        if report.overruns:
            print(f"exgrpo-train: dry run: the memory plan does not fit {gpu_gib:g} GiB per GPU at world size "
                  f"{world_size} (the WARNING lines above); exit {EXIT_PLAN_DOES_NOT_FIT}", file=sys.stderr)
            return EXIT_PLAN_DOES_NOT_FIT
        return 0
    startup_errors = (vllm_startup_errors(cfg) + moe_startup_errors(cfg) + peft_adapter_errors(cfg)
                      + memory_startup_errors(cfg, world_size))
    if startup_errors:
        print(f"exgrpo-train: {ConfigError(startup_errors)}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    return train_config(cfg, preemption, observers, algorithm)


def train_config(cfg: RootConfig, preemption: PreemptionHandler | None = None,
                 observers: Sequence[StepObserver] = (), algorithm: RLAlgorithm | None = None) -> int:
    """Train a validated config: the global rank 0 takes the run directory's lock first (before anything is
    written), then run_training; refusals at start-up (a config the checkpoint does not fit, an init_from or
    checkpoint that fails verification with none to fall back to) exit EXIT_INVALID_CONFIG, a failed save exits 1
    with its message (path and OS reason). `algorithm`: the one start-up validation built (else run_training builds
    it): a run builds its algorithm once."""
    from exgrpo_megatron.config.validate import ConfigError
    from exgrpo_megatron.distributed.launch_env import launch_env
    from exgrpo_megatron.distributed.run_lock import RunDirError, acquire_run_dir

    try:
        lock = acquire_run_dir(cfg.logging.run_dir) if launch_env().rank == 0 else None
    except RunDirError as exc:
        print(f"exgrpo-train: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    from exgrpo_megatron.distributed import cpu_shims

    cpu_shims.apply()  # before megatron-core is imported: its known CPU warnings are filtered (no-op on GPU)
    from exgrpo_megatron.checkpoint import CheckpointFormatError, CheckpointSaveError, IncompatibleCheckpointError
    from exgrpo_megatron.data.datasets import DataFileError, EmptyDatasetError
    from exgrpo_megatron.training.trainer import run_training

    try:
        return run_training(cfg, preemption, observers, algorithm)
    except (EmptyDatasetError, DataFileError, ConfigError, IncompatibleCheckpointError, CheckpointFormatError) as exc:
        print(f"exgrpo-train: {exc}", file=sys.stderr)
        if lock is not None:
            lock.release(refused=True)  # a refused start leaves no run directory or lock file behind
        return EXIT_INVALID_CONFIG
    except CheckpointSaveError as exc:
        print(f"exgrpo-train: {exc}", file=sys.stderr)
        return 1
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
