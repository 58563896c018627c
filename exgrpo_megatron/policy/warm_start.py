"""Supervised warm start for the built-in task: the demo's own small base model.

A from-scratch model solves nothing, so RL has no signal. Before RL, the demo trains the policy
with token cross-entropy on the task's solutions (`data/synthetic.py`: reasoning in think tags and
the answer in \\boxed{}), L = -sum_t log p(y_t | x, y_<t) / N_tokens, and caches the weights as a
weights-only checkpoint keyed by everything that determines them. RL then starts from them with a
fresh optimizer, exactly like `checkpoint.init_from`; training the entry leaves every RNG stream as it found it, so a
run that trains it and one that loads it continue identically. A cache entry is sealed with a manifest (size + sha256 of
every file, checkpoint/integrity.py) and verified before use; an entry that fails (or has no manifest) is named,
removed and trained again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from exgrpo_megatron.checkpoint.rng_io import rng_streams_kept
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.data.synthetic import task_fingerprint, warm_start_examples
from exgrpo_megatron.data.tokenizer import Tokenizer
from exgrpo_megatron.distributed.run_lock import pid_alive
from exgrpo_megatron.policy.batch import MicroBatch, collate, plan_micro_batches
from exgrpo_megatron.policy.output_layer import LastStageOutput
from exgrpo_megatron.policy.policy import LossFn, Policy

SFT_BATCH = 64


def warm_start_corpus_size(cfg: RootConfig) -> int:
    """Supervised examples the warm start draws from: `trainer.sft_warm_start_examples`, 0 = the training set's size
    (a preset with a small training set keeps the warm start of a larger one by naming that one's size)."""
    return cfg.trainer.sft_warm_start_examples or cfg.data.num_train_examples


def cache_key(cfg: RootConfig) -> str:
    """Digest of everything that determines the warm-start weights, the task's definition included
    (a changed tier in data/synthetic.py must not reuse weights trained on the old task)."""
    parts = {"model": asdict(cfg.model), "steps": cfg.trainer.sft_warm_start_steps,
             "lr": cfg.trainer.sft_warm_start_lr, "seed": cfg.seed, "template": cfg.data.template,
             "n": warm_start_corpus_size(cfg), "batch": SFT_BATCH,
             "task": task_fingerprint(tuple(cfg.data.arithmetic_tiers))}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _ce_loss(normaliser: float, vocab_size: int) -> LossFn:
    def loss_fn(output: LastStageOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, _ = output.logprobs_entropy(mb, vocab_size=vocab_size, with_entropy=False)
        loss = -(logp * mb.loss_mask).sum() / normaliser
        return loss, {"nll_sum": -(logp.detach() * mb.loss_mask).sum().double()}

    return loss_fn


def train_warm_start(cfg: RootConfig, tokenizer: Tokenizer, out_dir: Path) -> None:
    """Collective: SFT a fresh policy and save its weights to `out_dir` (model/ + model_config.yaml)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.checkpoint import model_config_to_yaml
    from exgrpo_megatron.checkpoint.integrity import write_weights_manifest

    t = cfg.trainer
    sft_cfg = replace(cfg, optim=replace(cfg.optim, lr=t.sft_warm_start_lr, lr_schedule="constant",
                                         lr_warmup_steps=0),
                      lora=replace(cfg.lora, rank=0))  # the base model is trained in full; LoRA starts from it
    policy = Policy(sft_cfg)
    pairs = warm_start_examples(warm_start_corpus_size(cfg), cfg.seed + 1, tiers=tuple(cfg.data.arithmetic_tiers),
                                template=cfg.data.template)
    seqs, plens = [], []
    for prompt, solution in pairs:
        p = tokenizer.encode(prompt)
        seqs.append(p + tokenizer.encode(solution) + [tokenizer.eos_token_id])
        plens.append(len(p))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(cfg.seed)
    policy.train()
    for step in range(t.sft_warm_start_steps):
        rows = torch.randint(0, len(seqs), (SFT_BATCH,), generator=g).tolist()
        normaliser = float(sum(len(seqs[i]) - plens[i] for i in rows))
        mine = rows[dp_rank::dp]
        plan = plan_micro_batches([len(seqs[i]) for i in mine], t.micro_batch_max_tokens)
        mbs = [collate(seqs, plens, [mine[j] for j in rows_]) for rows_ in plan]
        policy.zero_grad()
        out = policy.forward_backward(mbs, _ce_loss(normaliser, cfg.model.vocab_size), site="warm_start")
        policy.optimizer_step(skip_grad_bound=float("inf"))
        if (step + 1) % 50 == 0 and dist.get_rank() == 0:
            nll = float(sum(o["nll_sum"] for o in out)) * dp / normaliser
            print(f"warm start {step + 1}/{t.sft_warm_start_steps}: token nll {nll:.3f}", file=sys.stderr)
    # Written under a name of this run's own (two runs may train the same entry at once) and renamed into place;
    # the run that renames second finds the entry there and drops its copy (both trained the same weights).
    name = [staging_name(out_dir) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(name, src=0)
    tmp = out_dir.with_name(name[0])
    if dist.get_rank() == 0:
        remove_dead_staging(out_dir)
        (tmp / "model").mkdir(parents=True, exist_ok=True)
        (tmp / "model_config.yaml").write_text(model_config_to_yaml(cfg.model))
    dist.barrier()
    dist_checkpointing.save({"model": policy.modules[0].sharded_state_dict()}, str(tmp / "model"))
    dist.barrier()
    if dist.get_rank() == 0:
        write_weights_manifest(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another run's entry is already there (a non-empty directory is never replaced)
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()


def staging_name(out_dir: Path) -> str:
    """The directory a run writes a cache entry into before renaming it: named by host and process."""
    return f"{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}"


def remove_dead_staging(out_dir: Path) -> None:
    """Remove this host's staging directories of `out_dir` whose process is gone (a killed earlier attempt's)."""
    prefix = f"{out_dir.name}.tmp-{socket.gethostname()}-"
    for leftover in out_dir.parent.glob(f"{out_dir.name}.tmp*"):
        pid = leftover.name.removeprefix(prefix)
        if leftover.name == f"{out_dir.name}.tmp" or (pid.isdigit() and not pid_alive(int(pid))):
            shutil.rmtree(leftover, ignore_errors=True)


def usable_cache_entry(out_dir: Path) -> bool:
    """Collective: does the cache entry exist and verify? A failing one is named and removed (rank 0)."""
    from exgrpo_megatron.checkpoint import CheckpointVerificationError
    from exgrpo_megatron.checkpoint.integrity import verify_weights_dir

    if not out_dir.exists():
        return False
    try:
        verify_weights_dir(out_dir)
        return True
    except CheckpointVerificationError as err:
        if dist.get_rank() == 0:
            print(f"exgrpo-train: SFT warm-start cache entry rejected ({err}); removing it and training it again",
                  file=sys.stderr, flush=True)
            shutil.rmtree(out_dir, ignore_errors=True)
        dist.barrier()
        return False


def warm_start_weights(cfg: RootConfig, tokenizer: Tokenizer) -> Path:
    """The cached warm-start checkpoint for this config (verified), trained first if missing or damaged."""
    out_dir = Path(cfg.trainer.sft_cache_dir) / cache_key(cfg)
    with entry_lock(out_dir):
        if not usable_cache_entry(out_dir):
            if dist.get_rank() == 0:
                print(f"exgrpo-train: supervised warm start ({cfg.trainer.sft_warm_start_steps} steps) -> {out_dir}",
                      file=sys.stderr)
            with rng_streams_kept():  # the same streams after as a run that loads the entry (its model draws)
                train_warm_start(cfg, tokenizer, out_dir)
    return out_dir


@contextmanager
def entry_lock(out_dir: Path) -> Iterator[None]:
    """Collective: rank 0 holds an exclusive flock on `<entry>.lock` while the block runs, so a second run
    warm-starting the same entry waits for the first and then finds it made, instead of training it again. The
    kernel releases the lock of a killed run. Where the filesystem has no flock nothing is held (the staging names
    of `train_warm_start` still keep two writers apart)."""
    handle = None
    if dist.get_rank() == 0:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        handle = open(out_dir.with_name(out_dir.name + ".lock"), "a+")  # noqa: SIM115 - closed below
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"exgrpo-train: another run is training the warm-start entry {out_dir}; waiting for it",
                  file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # no flock on this filesystem
            pass
    dist.barrier()
    try:
        yield
    finally:
        if handle is not None:
            handle.close()
