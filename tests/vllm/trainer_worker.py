"""One training process for tests/vllm/test_trainer_vllm.py: the demo task on a small fp32 model with
rollout.engine=vllm, started from a weights-only checkpoint (`--make-init`) or resumed.

    python -m tests.vllm.trainer_worker RUN_DIR HF_DIR [--make-init PATH] -- OVERRIDES
"""

from __future__ import annotations

import argparse
import sys


def make_init(cfg, path: str) -> None:
    """Weights-only checkpoint that differs from what the Policy's constructor draws (another seed):
    if the engine missed the load, step 1 would roll out from the constructor's weights. With LoRA it holds
    adapters with non-zero B."""
    from exgrpo_megatron.checkpoint import model_config_to_yaml, save_model_weights
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.model.layout_init import initialise

    init_distributed(1, 1, seed=cfg.seed)
    lora = cfg.lora if cfg.lora.rank > 0 else None
    gpt = build_gpt_model(cfg.model, cfg.parallel, lora=lora)
    initialise([gpt], cfg.model, cfg.seed + 99, lora)
    if lora is not None:  # adapters with non-zero B: step 1 rolls out an adapted policy, not the base
        from tests.vllm.engines import randomise_adapters_

        randomise_adapters_([gpt], seed=cfg.seed + 7)
    save_model_weights(path, [gpt], model_config_yaml=model_config_to_yaml(cfg.model))


def main(argv: list[str]) -> int:
    import torch

    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.config.validate import validate
    from exgrpo_megatron.training.trainer import run_training
    from tests.vllm.engines import write_tiny_hf_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("hf_dir")
    parser.add_argument("--make-init", default=None)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    torch.set_num_threads(1)
    overrides = [f"logging.run_dir={args.run_dir}", f"model.hf_path={args.hf_dir}", *argv[split + 1:]]
    cfg = load_config("demo_cpu", overrides)
    write_tiny_hf_dir(args.hf_dir, cfg.model)
    if args.make_init:
        make_init(cfg, args.make_init)
        cfg = load_config("demo_cpu", [*overrides, f"checkpoint.init_from={args.make_init}"])
    validate(cfg, 1)
    return run_training(cfg)


if __name__ == "__main__":  # required: dist_checkpointing.save starts spawned helper processes
    sys.exit(main(sys.argv[1:]))
