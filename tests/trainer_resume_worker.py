"""One training process for tests/test_trainer_resume.py: `train_config` (exgrpo-train's path after validation:
run-directory lock, run_training, start-up refusals -> 2) on a tiny config, optionally with a test-side fault
injected, exiting with its exit code.

    python -m tests.trainer_resume_worker RUN_DIR [--make-init PATH] [--kill-in-save STEP] [--dump-pool-after-load]
        -- OVERRIDES

Environment: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (one process per rank).

--kill-in-save STEP         SIGKILL this process halfway through writing the pool shard of checkpoint STEP
                            (nothing in the product knows: the test replaces the checkpoint module's writer)
--fill-disk-in-save STEP    fill the run dir's filesystem (RUN_DIR/filler.bin, up to ENOSPC) just before the pool
                            shard of checkpoint STEP is written: another writer filling the disk mid-save
--kill-trainer-from-writer STEP
                            megatron's forked checkpoint writer of checkpoint STEP SIGKILLs the trainer, then keeps
                            writing for 600 s: the trainer dies (OOM killer, kill -9) while its forked writer lives
--make-init PATH            first write a weights-only checkpoint to PATH (TP=1/PP=1 only) that samples
                            "7" or <eos> most of the time (see digit_policy), and train from it
--dump-pool-after-load      right after RunState.load, write this rank's pool state to
                            RUN_DIR/pool_after_load_rank{R}.npz (arrays) + .json (meta)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np


def install_kill_in_save(step: int) -> None:
    """Make the save of checkpoint `step` die after writing half of its pool shard."""
    from exgrpo_megatron.checkpoint import layout, pool_io

    tmp_name = layout.TMP_PREFIX + layout.step_dir_name(step)
    real_write = pool_io.write_bytes_durable

    def write_then_die(path: Path, data: bytes) -> str:
        if path.parent.parent.name != tmp_name:  # <ckpts>/.tmp_step_X/pool/shard_*.safetensors
            return real_write(path, data)
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    pool_io.write_bytes_durable = write_then_die


def install_fill_disk_in_save(step: int, run_dir: str) -> None:
    """Make the save of checkpoint `step` meet a full disk: fill the filesystem, then write the pool shard."""
    from exgrpo_megatron.checkpoint import layout, pool_io

    tmp_name = layout.TMP_PREFIX + layout.step_dir_name(step)
    real_write = pool_io.write_bytes_durable

    def fill_then_write(path: Path, data: bytes) -> str:
        if path.parent.parent.name == tmp_name:
            fd = os.open(Path(run_dir) / "filler.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                while os.write(fd, b"\1" * (1 << 16)):
                    pass
            except OSError:
                pass  # the filesystem is full
            finally:
                os.close(fd)
        return real_write(path, data)

    pool_io.write_bytes_durable = fill_then_write


def install_kill_trainer_from_writer(step: int) -> None:
    """In the forked writer of checkpoint `step`: SIGKILL the trainer (the writer's parent), then go on writing."""
    import time

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from exgrpo_megatron.checkpoint import layout

    tmp_name = layout.TMP_PREFIX + layout.step_dir_name(step)
    real_write = FileSystemWriterAsync.write_preloaded_data

    def kill_then_write(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
        if tmp_name in str(write_bucket[0]):
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(600)  # a slow disk, or hung on its queue: still there when the trainer is gone
        return real_write(transform_list, local_proc_idx, write_bucket, *args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(kill_then_write)


def digit_policy(gpt, seven_id: int, eos_id: int) -> None:
    """Edit the layout-invariant initial weights so that a random policy still earns rewards: every
    token embeds close to the same direction e_0, so after the final RMSNorm h ~ sqrt(H) e_0 at every
    position, and output rows are -1 on e_0 except "7" and <eos> (0): each token is "7" or <eos> with
    ~48 % each. Responses "7", "77", ... then solve the questions whose answer they are, some of the time."""
    import torch

    with torch.no_grad():
        gpt.embedding.word_embeddings.weight[:, 0] += 1.0
        out = gpt.output_layer.weight
        out[:, 0] = -1.0
        out[[seven_id, eos_id], 0] = 0.0


def make_init(cfg, path: str) -> None:
    """Collective over a 1-rank world: the digit_policy weights as a weights-only checkpoint."""
    from exgrpo_megatron.checkpoint import model_config_to_yaml, save_model_weights
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.model.layout_init import initialise

    init_distributed(1, 1, seed=cfg.seed)  # run_training's own call re-seeds every RNG afterwards
    gpt = build_gpt_model(cfg.model, cfg.parallel)
    initialise([gpt], cfg.model, cfg.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    digit_policy(gpt, tokenizer.encode("7")[0], tokenizer.eos_token_id)
    save_model_weights(path, [gpt], model_config_yaml=model_config_to_yaml(cfg.model))


def install_pool_dump(run_dir: str) -> None:
    from exgrpo_megatron.training.run_state import RunState

    real_load = RunState.load

    def load_and_dump(self: RunState, loaded) -> None:
        real_load(self, loaded)
        path = loaded.path
        state = self.c.pool.state_dict()
        stem = Path(run_dir) / f"pool_after_load_rank{self.c.layout.rank}"
        np.savez(f"{stem}.npz", **state["arrays"])
        Path(f"{stem}.json").write_text(json.dumps({"meta": state["meta"], "loaded_from": str(path)}))

    RunState.load = load_and_dump


def main(argv: list[str]) -> int:
    import torch

    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.train import train_config

    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--kill-in-save", default=None)
    parser.add_argument("--dump-pool-after-load", action="store_true")
    parser.add_argument("--make-init", default=None)
    parser.add_argument("--fill-disk-in-save", default=None)
    parser.add_argument("--kill-trainer-from-writer", default=None)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.overrides = argv[split + 1:]
    torch.set_num_threads(1)
    if args.kill_in_save:
        install_kill_in_save(int(args.kill_in_save))
    if args.fill_disk_in_save:
        install_fill_disk_in_save(int(args.fill_disk_in_save), args.run_dir)
    if args.dump_pool_after_load:
        install_pool_dump(args.run_dir)
    if args.kill_trainer_from_writer:
        install_kill_trainer_from_writer(int(args.kill_trainer_from_writer))
    overrides = [f"logging.run_dir={args.run_dir}", *args.overrides]
    if args.make_init:
        make_init(load_config("demo_cpu", overrides), args.make_init)
        overrides.append(f"checkpoint.init_from={args.make_init}")
    cfg = load_config("demo_cpu", overrides)
    return train_config(cfg)  # as exgrpo-train after validation: run-dir lock, start-up refusals exit 2


if __name__ == "__main__":  # required: dist_checkpointing.save starts spawned helper processes
    sys.exit(main(sys.argv[1:]))
