"""Checkpoint save/load time and on-disk size: tiny model + Adam state + an experience-pool shard.

Single process (gloo world 1), tiny Qwen2-shaped model (2 layers, hidden 64, ffn 256, vocab 128; fp32),
megatron DDP + get_megatron_optimizer(adam) after one step so the Adam moments exist. The pool shard
has the real pool's state layout (experience/shard.py state_dict) at Q questions, 2 trajectories per
question of 64 tokens: qids/buckets/traj_counts int64 [Q]; traj_lengths/traj_steps int64 [2Q];
token_ids int32 [128Q]; logprobs float32 [128Q]; retired_ids int64 [Q/10]. Save = the full atomic
protocol (dist_checkpointing + pool + RNG + per-file sha256 + fsync + rename + latest); load = verify
every file (size + streaming sha256, integrity.py) + load model/optimizer + all pool shards + RNG;
verify = the verification alone (verify_checkpoint), timed side by side with the load in the same
repeat, so `verify/load` is the share of the load spent verifying. Wall time (perf_counter); the box is
shared, so treat the times as upper bounds and compare the ratio.

    python bench/checkpoint.py          # writes bench/results/checkpoint.json
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

QUESTION_COUNTS = [10_000, 100_000]
TRAJ_PER_QUESTION, TOKENS = 2, 64
REPEATS = 3


def pool_shard(n_questions: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n_traj = n_questions * TRAJ_PER_QUESTION
    arrays = {
        "qids": np.arange(n_questions, dtype=np.int64),
        "buckets": rng.integers(1, 8, n_questions).astype(np.int64),
        "traj_counts": np.full(n_questions, TRAJ_PER_QUESTION, dtype=np.int64),
        "traj_lengths": np.full(n_traj, TOKENS, dtype=np.int64),
        "traj_steps": rng.integers(0, 700, n_traj).astype(np.int64),
        "token_ids": rng.integers(0, 152_064, n_traj * TOKENS, dtype=np.int32),
        "logprobs": -rng.exponential(1.0, n_traj * TOKENS).astype(np.float32),
        "retired_ids": np.arange(n_questions, n_questions + n_questions // 10, dtype=np.int64),
    }
    meta = {"format": "exgrpo_experience_shard", "version": 1, "group_size": 8, "lbound": 0, "rbound": 7}
    return arrays, meta


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    import torch

    from exgrpo_megatron.distributed.launch_env import free_local_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()))
    torch.set_num_threads(1)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from exgrpo_megatron.checkpoint import load_checkpoint, model_config_to_yaml, save_checkpoint, verify_checkpoint
    from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig
    from exgrpo_megatron.distributed.runtime import destroy_distributed, init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model, causal_attention_mask

    model_config = ModelConfig(params_dtype="fp32", layer_spec="local")
    init_distributed(1, 1, seed=1)
    gpt = build_gpt_model(model_config, ParallelConfig())
    ddp = DistributedDataParallel(config=gpt.config, module=gpt, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32), [ddp])
    tokens = torch.randint(0, 128, (2, 17))
    loss = gpt(tokens[:, :-1], torch.arange(16).expand(2, 16), causal_attention_mask(16, 2), labels=tokens[:, 1:])
    loss = loss.float().mean()
    loss.backward()
    optimizer.step()
    n_params = sum(p.numel() for p in gpt.parameters())

    rows = []
    for n_questions in QUESTION_COUNTS:
        shard = pool_shard(n_questions)
        pool_array_bytes = sum(a.nbytes for a in shard[0].values())
        save_s, load_s, verify_s = [], [], []
        for repeat in range(REPEATS):
            with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as run_dir:
                t0 = time.perf_counter()
                path = save_checkpoint(
                    run_dir, 10, model_chunks=[gpt], optimizer=optimizer, pool_shard=shard, pool_shard_index=(0, 1),
                    trainer_state={"step": 10}, config_yaml="bench: true\n",
                    model_config_yaml=model_config_to_yaml(model_config), keep_last=2,
                )
                save_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                verify_checkpoint(path)
                verify_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                loaded = load_checkpoint(path, model_chunks=[gpt], model_config=model_config, optimizer=optimizer)
                load_s.append(time.perf_counter() - t0)
                assert loaded.pool_shards[0][0]["token_ids"].shape == shard[0]["token_ids"].shape
                sizes = {"model_dir_bytes": tree_bytes(path / "model"), "pool_dir_bytes": tree_bytes(path / "pool"),
                         "total_bytes": tree_bytes(path)}
            print(f"  questions={n_questions} repeat={repeat}: save {save_s[-1]:.2f}s load {load_s[-1]:.2f}s "
                  f"(verify alone {verify_s[-1]:.2f}s)", flush=True)
        rows.append({"questions": n_questions, "trajectories": n_questions * TRAJ_PER_QUESTION,
                     "pool_array_bytes": pool_array_bytes, "save_s_min": min(save_s), "load_s_min": min(load_s),
                     "verify_s_min": min(verify_s), "verify_over_load": min(verify_s) / min(load_s),
                     "verify_mib_per_s": sizes["total_bytes"] / 2**20 / min(verify_s),
                     "save_s_all": save_s, "load_s_all": load_s, "verify_s_all": verify_s, **sizes})
    destroy_distributed()

    print(f"\nmodel params {n_params:,} (fp32) + Adam; pool: {TRAJ_PER_QUESTION} traj/question x {TOKENS} tokens")
    print(f"{'questions':>10} {'pool MiB':>9} {'model/ MiB':>10} {'pool/ MiB':>9} {'total MiB':>9} "
          f"{'save s':>7} {'load s':>7} {'verify s':>8} {'verify/load':>11}  (min of {REPEATS}; load includes verify)")
    for r in rows:
        print(f"{r['questions']:>10,} {r['pool_array_bytes'] / 2**20:>9.1f} {r['model_dir_bytes'] / 2**20:>10.2f} "
              f"{r['pool_dir_bytes'] / 2**20:>9.1f} {r['total_bytes'] / 2**20:>9.1f} "
              f"{r['save_s_min']:>7.2f} {r['load_s_min']:>7.2f} {r['verify_s_min']:>8.3f} "
              f"{r['verify_over_load']:>11.2f}")
    out = Path(__file__).resolve().parent / "results" / "checkpoint.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "description": __doc__.strip().splitlines()[0],
        "model_params": n_params, "traj_per_question": TRAJ_PER_QUESTION, "tokens_per_traj": TOKENS,
        "repeats": REPEATS, "machine": platform.platform(), "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(), "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":  # required: dist_checkpointing.save starts spawned workers
    main()
