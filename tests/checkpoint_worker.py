"""Helpers for tests/test_checkpoint.py and a script for the tests that need a real process to kill.

Helpers: a tiny GPTModel + megatron DDP + get_megatron_optimizer (adam), one optimizer step on a fixed
global batch split over DP, full (TP-gathered, PP-renamed) weights, synthetic pool shards.

Script modes (`python -m tests.checkpoint_worker MODE RUN_DIR`, env RANK/WORLD_SIZE/MASTER_*):
  kill     save step 1, then save step 2 and SIGKILL itself halfway through writing the pool shard
  resume   find_latest + load it, report the loaded step, then save step 3 (cleans stale .tmp_*)
  preempt  save step 0, then a PreemptionHandler loop until should_stop(), then save and exit
           REQUEUE_EXIT_CODE
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig

# make_vocab_size_divisible_by=64: vocab 128 pads to 128 at TP=1 and TP=2, so embeddings reshard.
TINY = ModelConfig(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
    vocab_size=128, make_vocab_size_divisible_by=64, max_position_embeddings=64,
    params_dtype="fp32", layer_spec="local",
)
GLOBAL_BATCH, SEQ = 4, 16


def build_tiny_trainer(tp: int, pp: int, seed: int = 1234, model_config: ModelConfig = TINY):
    """(layout, unwrapped GPTModel, DDP wrapper, megatron optimizer) on this rank."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model

    layout = init_distributed(tp, pp, seed=seed)
    gpt = build_gpt_model(model_config, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    ddp = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, adam_beta2=0.95, clip_grad=1.0, params_dtype=torch.float32)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    return layout, gpt, ddp, optimizer


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)


def train_step(layout, ddp, optimizer, step: int) -> float | None:
    """One Adam step on global_batch(step) (rows split over DP). Returns the global mean token loss on
    last-stage ranks (None elsewhere). Loss = token-sum; megatron divides grads by the global token count."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from exgrpo_megatron.model.builder import causal_attention_mask

    local = global_batch(step)[layout.dp_rank :: layout.dp_size]
    tokens, labels = local[:, :-1].contiguous(), local[:, 1:].contiguous()
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)

    def forward_step(data_iterator, model):
        tok, lab = next(data_iterator)
        out = model(input_ids=tok, position_ids=positions, attention_mask=causal_attention_mask(s, b), labels=lab)

        def loss_func(loss_per_token):
            loss_sum = loss_per_token.float().sum()
            n_tokens = torch.tensor(loss_per_token.numel(), dtype=torch.int)
            return loss_sum, n_tokens, {"sum_and_count": torch.stack([loss_sum.detach().clone(), n_tokens.float()])}

        return out, loss_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([(tokens, labels)]), model=[ddp],
        num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=False,
    )
    ok, _grad_norm, _ = optimizer.step()
    assert ok
    if not layout.is_last_stage:
        return None
    total = reports[0]["sum_and_count"].double()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total[0] / total[1])


def full_weights(gpt, layout) -> dict[str, np.ndarray]:
    """This rank's parameters as FULL tensors under global names: TP shards all-gathered (stride-2
    SwiGLU fc1 re-interleaved), PP stage-local layer indices renamed to global ones."""
    from megatron.core import parallel_state as ps

    layers_per_stage = TINY.num_layers // layout.pp_size
    out = {}
    for name, p in gpt.named_parameters():
        t = p.detach().clone()
        if layout.tp_size > 1 and getattr(p, "tensor_model_parallel", False):
            shards = [torch.empty_like(t) for _ in range(layout.tp_size)]
            dist.all_gather(shards, t, group=ps.get_tensor_model_parallel_group())
            dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
            pieces = [shard.chunk(stride, dim=dim) for shard in shards]
            t = torch.cat([pieces[r][k] for k in range(stride) for r in range(layout.tp_size)], dim=dim)
        if name.startswith("decoder.layers."):
            local_index = int(name.split(".")[2])
            rest = name.split(".", 3)[3]
            name = f"decoder.layers.{local_index + layout.pp_rank * layers_per_stage}.{rest}"
        out[name] = t.numpy()
    return out


def synthetic_pool_shard(n_questions: int, seed: int, traj_per_question: int = 2, tokens: int = 64):
    """Arrays shaped like a pool shard: per trajectory `tokens` int32 ids + float32 log-probs."""
    rng = np.random.default_rng(seed)
    n_traj = n_questions * traj_per_question
    arrays = {
        "question_id": np.arange(n_questions, dtype=np.int64) + seed * 10**6,
        "traj_question_index": np.repeat(np.arange(n_questions, dtype=np.int32), traj_per_question),
        "traj_tokens": rng.integers(0, 32000, size=(n_traj, tokens), dtype=np.int32),
        "traj_logprobs": rng.standard_normal((n_traj, tokens)).astype(np.float32),
        "traj_length": rng.integers(1, tokens + 1, size=n_traj, dtype=np.int32),
        "correct_count": rng.integers(0, 9, size=n_questions, dtype=np.int8),
        "retired": rng.random(n_questions) < 0.1,
    }
    return arrays, {"version": 1, "seed": seed, "n_questions": n_questions, "buckets": [0.0, 0.25, 0.5]}


def _save(run_dir: str, step: int, gpt, optimizer, layout, pool_seed: int) -> Path:
    from exgrpo_megatron.checkpoint import model_config_to_yaml, save_checkpoint

    return save_checkpoint(
        run_dir, step, model_chunks=[gpt], optimizer=optimizer,
        pool_shard=synthetic_pool_shard(64, pool_seed), pool_shard_index=(layout.dp_rank, layout.dp_size),
        trainer_state={"step": step}, config_yaml="seed: 1234\n", model_config_yaml=model_config_to_yaml(TINY),
        keep_last=5,
    )


def _kill_mid_pool_write(path: Path, data: bytes) -> str:
    """Stand-in for the durable writer: write half the shard, then die as if the node was lost."""
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def main(mode: str, run_dir: str) -> None:
    from exgrpo_megatron.checkpoint import find_latest, load_checkpoint, pool_io
    from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE, PreemptionHandler

    torch.set_num_threads(1)
    layout, gpt, ddp, optimizer = build_tiny_trainer(1, 1)
    if mode == "kill":
        train_step(layout, ddp, optimizer, 0)
        _save(run_dir, 1, gpt, optimizer, layout, pool_seed=1)
        train_step(layout, ddp, optimizer, 1)
        pool_io.write_bytes_durable = _kill_mid_pool_write
        _save(run_dir, 2, gpt, optimizer, layout, pool_seed=2)
    elif mode == "resume":
        latest = find_latest(run_dir)
        loaded = load_checkpoint(latest, model_chunks=[gpt], model_config=TINY, optimizer=optimizer)
        saved = _save(run_dir, 3, gpt, optimizer, layout, pool_seed=3)
        Path(run_dir, "resume_report.json").write_text(json.dumps(
            {"latest": latest.name, "step": loaded.step, "n_shards": len(loaded.pool_shards), "saved": saved.name}
        ))
    elif mode == "preempt":
        handler = PreemptionHandler().install()
        _save(run_dir, 0, gpt, optimizer, layout, pool_seed=layout.dp_rank)  # a periodic save before the signal
        Path(run_dir, f"ready_{layout.rank}").write_text(str(os.getpid()))
        step = 0
        while not handler.should_stop():
            step += 1
            time.sleep(0.02)
            if step > 30000:
                sys.exit(3)
        _save(run_dir, step, gpt, optimizer, layout, pool_seed=layout.dp_rank)
        Path(run_dir, f"stopped_{layout.rank}.json").write_text(
            json.dumps({"step": step, "own_signal": handler.received_signal})
        )
        dist.barrier()
        sys.exit(REQUEUE_EXIT_CODE)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":  # required: dist_checkpointing.save starts spawned workers
    main(sys.argv[1], sys.argv[2])
