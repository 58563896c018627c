"""`python -m exgrpo_megatron.train --config-name <preset> [hydra overrides]` (console script `exgrpo-train`).

    exgrpo-train --config-name exgrpo_7b trainer.experience_ratio=0.25 ++parallel.tensor_model_parallel_size=4
    exgrpo-train --config-name exgrpo_7b --dry-run --world-size 16     # validate + print the plan, no model

Every rank runs this same entry point (torchrun or srun). The config is composed and validated
before any process group exists; an invalid config exits with status 2 and `key: reason` lines.
"""

from __future__ import annotations

import argparse
import sys

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import ConfigError, validate, vllm_startup_errors
from exgrpo_megatron.distributed.launch_env import launch_env

EXIT_INVALID_CONFIG = 2


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="exgrpo-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default="demo_cpu", help="preset in conf/ (without .yaml)")
    parser.add_argument("--config-dir", "-cd", default=None, help="config directory (default: the repo's conf/)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan; build nothing")
    parser.add_argument("--world-size", type=int, default=None,
                        help="world size to validate against (default: from torchrun/Slurm, else 1)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    world_size = args.world_size or launch_env().world_size
    try:
        cfg = load_config(args.config_name, overrides, args.config_dir)
        validate(cfg, world_size)
    except ConfigError as exc:
        print(f"exgrpo-train: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    if args.dry_run or cfg.dry_run:
        from exgrpo_megatron.config.dry_run import dry_run_report

        print(dry_run_report(cfg, world_size))
        return 0
    startup_errors = vllm_startup_errors(cfg)
    if startup_errors:
        print(f"exgrpo-train: {ConfigError(startup_errors)}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    from exgrpo_megatron.trainer import run_training

    return run_training(cfg)


if __name__ == "__main__":
    sys.exit(main())
