"""Checkpoint / resume through the real training loop (`run_training`, one process per rank):

* an uninterrupted 6-step run vs the same run stopped cleanly after step 3 (total_steps=3, then extended
  to 6), SIGKILLed halfway through writing step 4's pool shard, and resumed each time with
  checkpoint.resume=auto: identical per-step metrics (bitwise), final weights, Adam moments, LR scheduler,
  sampler / switch / pool state;
* SIGTERM to the trainer mid-run: exit code 75 after a complete checkpoint of the finished step,
  and the resumed run reproduces the uninterrupted one just as bitwise;
* resharding TP=2 -> TP=1 (at PP=2), PP=2 -> PP=1 (at DP=2), DP=2 -> DP=1: every pool entry survives;
* updates skipped (grad norm above algo.skip_grad_bound) algo.max_consecutive_skips times in a row
  stop the run with exit code 3, weights untouched.

The policy starts from `digit_policy` weights (tests/trainer_resume_worker.py) so that rewards, the
pool and replay are non-trivial from step 1. Run:
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_trainer_resume.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from exgrpo_megatron.checkpoint import find_latest
from exgrpo_megatron.checkpoint.checkpointer import POOL_MANIFEST_FILE, read_root_manifest
from exgrpo_megatron.checkpoint.pool_io import read_pool_shards
from exgrpo_megatron.distributed.launch_env import free_local_port
from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE
from exgrpo_megatron.logging import read_metrics
from tests.helpers.rank_processes import log_tail, reap, start_rank_process

N_STEPS = 6
TIMEOUT_S = 400


# ------------------------------------------------------------------ running the trainer


def _write_dataset(path: Path) -> str:
    """64 questions whose answers a policy that emits "7"s and <eos> solves some of the time."""
    golds = ("7", "7", "77")
    rows = [{"prompt": f"q{i}: what is {i}+{i}?", "reward_model": {"ground_truth": golds[i % 3]}} for i in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _overrides(data_file: str, total_steps: int, tp: int = 1, pp: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "model=tiny_qwen2", "model.vocab_size=103", "model.make_vocab_size_divisible_by=64",  # 128 rows at TP 1 and 2
        "logging.tensorboard=false", "logging.progress_bar=false", "data.source=files",
        f"data.train_files=[{data_file}]", "reward.require_think=false", f"trainer.total_steps={total_steps}",
        "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=4",
        "experience.admit_correct_at_most=3",
        "experience.delayed_start_pass_rate=0", "trainer.sft_warm_start_steps=0", "trainer.val_every=0",
        "data.max_response_length=12", "trainer.micro_batch_max_tokens=256", "checkpoint.save_every=2",
        "checkpoint.keep_last=3", "optim.lr=1e-3", "optim.adam_eps=1e-3", "reward.num_workers=1",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}", *extra,
    ]


def _launch(run_dir: Path, overrides: list[str], world: int = 1, worker_args: tuple[str, ...] = (),
            tag: str = "run") -> list[subprocess.Popen]:
    """One worker process per rank (see tests/helpers/rank_processes.py), output to run_dir/<tag>_<rank>.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_local_port()
    args = ["-m", "tests.trainer_resume_worker", str(run_dir), *worker_args, "--", *overrides]
    return [start_rank_process(args, run_dir / f"{tag}_{rank}.log", rank, world, port) for rank in range(world)]


def _finish(procs: list[subprocess.Popen]) -> list[int]:
    return [reap(proc, TIMEOUT_S) for proc in procs]


def _logs(procs: list[subprocess.Popen]) -> str:
    return log_tail(procs, 4000)


def _train(run_dir: Path, overrides: list[str], world: int = 1, worker_args: tuple[str, ...] = (),
           expect: int = 0, tag: str = "run") -> str:
    procs = _launch(run_dir, overrides, world, worker_args, tag)
    codes = _finish(procs)
    assert codes == [expect] * world, f"{tag}: exit codes {codes}, expected {expect}\n{_logs(procs)}"
    return procs[0].log_path.read_text()


# ------------------------------------------------------------------ reading results


def _comparable(record: dict) -> dict:
    """Everything a step logs except wall-clock timings."""
    return {k: v for k, v in record.items() if not k.startswith(("time/", "throughput/"))}


def _assert_same_metrics(run_dir: Path, reference: list[dict]) -> None:
    got = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in got] == [r["step"] for r in reference]
    for g, r in zip(got, reference, strict=True):
        assert _comparable(g) == _comparable(r), f"step {r['step']} differs"


def _ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _model_tensors(ckpt: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's model/ (weights and Adam moments, full global shapes) plus the
    non-sharded optimizer state (step count, param groups), read with torch.distributed.checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{ckpt.parent.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt / "model"), str(out))
    tensors = {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}
    common = ckpt / "model" / "common.pt"
    if common.exists():
        tensors["common"] = torch.load(common, weights_only=False)
    return tensors


def _assert_same_tensors(got: dict, want: dict, keys=None) -> None:
    keys = sorted(want) if keys is None else keys
    assert keys and set(keys) <= set(got)
    for key in keys:
        if key == "common":
            assert repr(got[key]) == repr(want[key])
        else:
            assert torch.equal(got[key], want[key]), key


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _pool_shards(ckpt: Path) -> list[tuple[dict, dict]]:
    """The pool shards of a checkpoint, verified against its manifest (the checkpoint module's reader)."""
    files = read_root_manifest(ckpt)["files"]
    return read_pool_shards(ckpt / "pool", files[POOL_MANIFEST_FILE])


def _pool_entries(arrays: dict) -> set[tuple]:
    """{(qid, bucket, ((token ids, log-prob bytes, step), ...))} of one shard's state arrays."""
    lengths = np.asarray(arrays["traj_lengths"])
    token_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    traj_offsets = np.concatenate([[0], np.cumsum(arrays["traj_counts"])]).astype(int)
    entries = set()
    for i, (qid, bucket) in enumerate(zip(arrays["qids"].tolist(), arrays["buckets"].tolist(), strict=True)):
        trajs = tuple(
            (tuple(arrays["token_ids"][token_offsets[j]:token_offsets[j + 1]].tolist()),
             arrays["logprobs"][token_offsets[j]:token_offsets[j + 1]].astype(np.float32).tobytes(),
             int(arrays["traj_steps"][j]))
            for j in range(traj_offsets[i], traj_offsets[i + 1]))
        entries.add((int(qid), int(bucket), trajs))
    return entries


def _saved_pool(ckpt: Path) -> tuple[set, set]:
    shards = _pool_shards(ckpt)
    entries = set().union(*(_pool_entries(a) for a, _ in shards))
    assert sum(len(a["qids"]) for a, _ in shards) == len(entries)  # no question in two shards
    retired = set().union(*(a["retired_ids"].tolist() for a, _ in shards))
    return entries, retired


def _loaded_pool(run_dir: Path, rank: int) -> tuple[set, set, str]:
    """What rank `rank` held right after RunState.load (written by the worker's --dump-pool-after-load)."""
    with np.load(run_dir / f"pool_after_load_rank{rank}.npz") as data:
        arrays = {k: data[k] for k in data.files}
    info = _json(run_dir / f"pool_after_load_rank{rank}.json")
    return _pool_entries(arrays), set(arrays["retired_ids"].tolist()), Path(info["loaded_from"]).name


def _assert_same_pool(got: Path, want: Path) -> None:
    a, b = _pool_shards(got), _pool_shards(want)
    assert len(a) == len(b)
    for (arrays, meta), (want_arrays, want_meta) in zip(a, b, strict=True):
        assert meta == want_meta and set(arrays) == set(want_arrays)
        for name in arrays:
            np.testing.assert_array_equal(arrays[name], want_arrays[name], err_msg=name)


# ------------------------------------------------------------------ the uninterrupted reference


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_resume")
    data = _write_dataset(root / "train.jsonl")
    run_dir, init = root / "reference", root / "init"
    _train(run_dir, _overrides(data, N_STEPS), worker_args=("--make-init", str(init)))
    metrics = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in metrics] == list(range(1, N_STEPS + 1))
    # the run exercises what a resume must carry: rewards, a growing pool, replayed questions
    assert metrics[0]["reward/mean"] > 0 and metrics[-1]["experience/questions"] >= 2
    assert sum(r["experience/n_replayed"] for r in metrics) >= 2
    return {"root": root, "data": data, "init": init, "run_dir": run_dir, "metrics": metrics}


# ------------------------------------------------------------------ tests


def _assert_same_final_checkpoint(run_dir: Path, reference: dict, scratch: Path) -> None:
    """Weights, Adam moments and step count, LR scheduler, trainer state (sampler position: no prompt
    replayed or skipped; switch; skip counter) and pool shards of the last checkpoint, bitwise."""
    got, want = _ckpt(run_dir, N_STEPS), _ckpt(reference["run_dir"], N_STEPS)
    want_tensors = _model_tensors(want, scratch)
    assert any(k.startswith("optimizer.") for k in want_tensors)
    _assert_same_tensors(_model_tensors(got, scratch), want_tensors)
    for name in ("trainer_state.json", "opt_param_scheduler.json"):
        assert _json(got / "state" / name) == _json(want / "state" / name), name
    _assert_same_pool(got, want)


def test_stopped_and_killed_mid_save_runs_reproduce_the_uninterrupted_run_bitwise(reference, tmp_path):
    data, run_dir = reference["data"], tmp_path / "interrupted"
    ckpts = run_dir / "checkpoints"
    # (a) a clean stop: total_steps=3 saves 2 and (last step) 3; the resumes below extend it to 6 steps,
    # which also checks that the LR schedule follows the config's new horizon (scheduler_state.py)
    _train(run_dir, _overrides(data, 3), worker_args=("--make-init", str(tmp_path / "init")), tag="a")
    assert find_latest(run_dir) == _ckpt(run_dir, 3)
    # (b) SIGKILL halfway through writing step 4's pool shard: step 3 stays the newest complete checkpoint
    log = _train(run_dir, _overrides(data, N_STEPS), worker_args=("--kill-in-save", "4"),
                 expect=-signal.SIGKILL, tag="b")
    assert f"resumed from {_ckpt(run_dir, 3)} at step 3" in log
    assert list((ckpts / ".tmp_step_00000004" / "pool").glob("shard_*")) and not _ckpt(run_dir, 4).exists()
    assert find_latest(run_dir) == _ckpt(run_dir, 3)
    assert read_metrics(str(run_dir / "metrics.jsonl"))[-1]["step"] == 4  # logged, then lost with the save
    # (c) resume from 3 again (step 4 is recomputed, its stale metrics line dropped) and finish
    log = _train(run_dir, _overrides(data, N_STEPS), tag="c")
    assert f"resumed from {_ckpt(run_dir, 3)} at step 3" in log
    assert not (ckpts / ".tmp_step_00000004").exists()  # the next save cleaned the leftover

    _assert_same_metrics(run_dir, reference["metrics"])
    _assert_same_final_checkpoint(run_dir, reference, tmp_path)


def test_sigterm_saves_the_finished_step_exits_75_and_resumes(reference, tmp_path):
    run_dir = tmp_path / "preempted"
    procs = _launch(run_dir, _overrides(reference["data"], N_STEPS), worker_args=("--make-init", str(tmp_path / "i")))
    metrics_path = run_dir / "metrics.jsonl"
    deadline = time.time() + TIMEOUT_S
    try:
        while not (metrics_path.exists() and metrics_path.read_text().strip()):
            assert time.time() < deadline and procs[0].poll() is None, _logs(procs)
            time.sleep(0.01)
        # Only the trainer process, as torchrun forwards it. (Signalling the whole process group, as Slurm
        # does, also kills the grader's fork server and workers, and the grader pool can then break
        # mid-step -- "dispatcher crashed: ConnectionRefusedError" -- so the run exits 1, not 75.)
        os.kill(procs[0].pid, signal.SIGTERM)
    finally:
        codes = _finish(procs)
    assert codes == [REQUEUE_EXIT_CODE], _logs(procs)
    stopped_at = read_metrics(str(metrics_path))[-1]["step"]
    assert 1 <= stopped_at < N_STEPS
    latest = find_latest(run_dir)
    assert latest == _ckpt(run_dir, stopped_at)
    assert read_root_manifest(latest)["step"] == stopped_at

    log = _train(run_dir, _overrides(reference["data"], N_STEPS), tag="resume")
    assert f"resumed from {latest} at step {stopped_at}" in log
    _assert_same_metrics(run_dir, reference["metrics"])
    _assert_same_final_checkpoint(run_dir, reference, tmp_path)


def test_reshard_tp2_pp2_dp2_keeps_every_pool_entry(reference, tmp_path):
    data, run_dir = reference["data"], tmp_path / "reshard"
    init = f"checkpoint.init_from={reference['init']}"
    dump = ("--dump-pool-after-load",)
    _train(run_dir, _overrides(data, 2, tp=2, extra=(init,)), world=2, tag="tp2")
    saved = _saved_pool(_ckpt(run_dir, 2))
    assert saved[0], "the TP=2 run stored nothing in the pool"
    # TP=2 -> TP=1 (PP=2): each stage holds its replica's whole shard
    _train(run_dir, _overrides(data, 3, pp=2), world=2, worker_args=dump, tag="pp2")
    for rank in range(2):
        assert _loaded_pool(run_dir, rank) == (*saved, "step_00000002")
    # PP=2 -> PP=1 (DP=2): the entries are split between the two replicas, none lost or duplicated
    saved = _saved_pool(_ckpt(run_dir, 3))
    _train(run_dir, _overrides(data, 4), world=2, worker_args=dump, tag="dp2")
    (e0, r0, f0), (e1, r1, f1) = _loaded_pool(run_dir, 0), _loaded_pool(run_dir, 1)
    assert f0 == f1 == "step_00000003" and not e0 & e1 and e0 | e1 == saved[0] and r0 == r1 == saved[1]
    assert e0 and e1, "choose data so that both DP ranks own a pool entry"
    # DP=2 -> DP=1: both shards land on the one rank
    saved = _saved_pool(_ckpt(run_dir, 4))
    assert len(_pool_shards(_ckpt(run_dir, 4))) == 2
    _train(run_dir, _overrides(data, 5), worker_args=dump, tag="dp1")
    assert _loaded_pool(run_dir, 0) == (*saved, "step_00000004")
    assert [r["step"] for r in read_metrics(str(run_dir / "metrics.jsonl"))] == [1, 2, 3, 4, 5]
    assert find_latest(run_dir) == _ckpt(run_dir, 5)


def test_start_up_refusals_exit_2_naming_the_key_or_file_and_write_nothing(reference, tmp_path):
    """A resume that changes the model's shape or algo.name, and an init_from with a flipped byte: exit 2 at
    start-up naming the key / the file (old code: shape -> traceback with rc 1; algo.name -> the pool dropped
    in silence; init_from -> training from the damaged weights)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(reference["run_dir"], run_dir)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for change, named in (("model.num_layers=3", "model.num_layers: checkpoint 2, config 3"),
                          ("algo.name=grpo", "algo.name: checkpoint 'exgrpo' -> config 'grpo'")):
        log = _train(run_dir, [*_overrides(reference["data"], N_STEPS), change,
                               f"checkpoint.init_from={reference['init']}"], expect=2, tag=change.split("=")[0])
        assert named in log
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    init = tmp_path / "init"
    shutil.copytree(reference["init"], init)
    victim = max((init / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    log = _train(tmp_path / "fresh", [*_overrides(reference["data"], N_STEPS), f"checkpoint.init_from={init}"],
                 expect=2, tag="init_from")
    assert f"{victim}: sha256 mismatch" in log
    assert not (tmp_path / "fresh" / "checkpoints").exists() and not (tmp_path / "fresh" / "metrics.jsonl").exists()


def test_consecutive_skipped_updates_stop_the_run_with_code_3(reference, tmp_path):
    run_dir = tmp_path / "skips"
    extra = (f"checkpoint.init_from={reference['init']}", "algo.skip_grad_bound=1e-12", "algo.max_consecutive_skips=3")
    log = _train(run_dir, _overrides(reference["data"], N_STEPS, extra=extra), expect=3)
    assert "stopping: 4 consecutive updates skipped" in log and "algo.skip_grad_bound=1e-12" in log
    metrics = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [(r["step"], r["optim/consecutive_skips"]) for r in metrics] == [(1, 2.0), (2, 4.0)]
    # the stop saved a checkpoint, and no update touched the weights
    tensors = _model_tensors(_ckpt(run_dir, 2), tmp_path)
    initial = _model_tensors(reference["init"], tmp_path)
    _assert_same_tensors(tensors, initial, keys=[k for k in initial if k != "common"])


class _StubOptimizer:
    """What OptimizerParamScheduler touches: param_groups."""

    def __init__(self) -> None:
        self.param_groups = [{"wd_mult": 1.0}]


def _cosine(updates: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = _StubOptimizer()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=1e-3, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=0, lr_decay_steps=updates,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=updates, wd_incr_style="constant")
    return optimizer, scheduler


def test_resume_takes_progress_from_the_checkpoint_and_the_schedule_from_the_config():
    """A 3-step run (6 updates) extended to 6 steps: megatron's own load_state_dict would keep the
    6-update cosine horizon (lr = min_lr from here on); the restore keeps the config's 12-update one."""
    from exgrpo_megatron.checkpoint.scheduler_state import restore_scheduler

    _, short = _cosine(6)
    short.step(increment=6)
    saved = json.loads(json.dumps(short.state_dict()))  # as stored in state/opt_param_scheduler.json
    optimizer, resumed = _cosine(12)
    assert restore_scheduler(resumed, saved) == {"lr_decay_steps": (6, 12), "wd_incr_steps": (6, 12)}
    uninterrupted_optimizer, uninterrupted = _cosine(12)
    uninterrupted.step(increment=6)
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert optimizer.param_groups == uninterrupted_optimizer.param_groups
    assert 1e-5 < optimizer.param_groups[0]["lr"] < 1e-3

    _, megatron_load = _cosine(12)
    megatron_load.load_state_dict(saved)
    assert megatron_load.lr_decay_steps == 6  # the behaviour restore_scheduler replaces
