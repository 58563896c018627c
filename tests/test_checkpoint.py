"""Checkpoints: TP/PP/DP resharding with exact weights and an unchanged optimizer trajectory, pool
shards, RNG, crash safety (a real SIGKILL mid-save), corruption, incompatible configs, disk space,
retention, the `latest` pointer, and preemption signals.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_checkpoint.py -x
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from exgrpo_megatron.checkpoint import (
    CheckpointFormatError,
    IncompatibleCheckpointError,
    InsufficientDiskSpaceError,
    find_latest,
    load_checkpoint,
    load_model_weights,
    model_config_to_yaml,
    resolve_resume,
    save_checkpoint,
    save_model_weights,
)
from exgrpo_megatron.checkpoint import layout as L
from exgrpo_megatron.distributed.launch_env import free_local_port
from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE
from tests.checkpoint_worker import TINY, build_tiny_trainer, full_weights, synthetic_pool_shard, train_step
from tests.helpers.multirank import run_on_ranks
from tests.helpers.rank_processes import log_tail, reap, start_rank_process

LOSS_RTOL = 1e-6


def _save(run_dir, step, gpt, optimizer, layout, pool, keep_last=5, trainer_state=None):
    return save_checkpoint(
        run_dir, step, model_chunks=[gpt], optimizer=optimizer, opt_param_scheduler=None,
        pool_shard=pool, pool_shard_index=(layout.dp_rank, layout.dp_size),
        trainer_state=trainer_state or {"step": step, "mixed_mode": True, "sampler": {"epoch": 1, "position": 7}},
        config_yaml="seed: 1234\nmodel: tiny\n", model_config_yaml=model_config_to_yaml(TINY), keep_last=keep_last,
    )


def _rng_draws() -> list[float]:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker_draw = float(torch.rand(1))
    return [random.random(), float(np.random.rand()), float(torch.rand(1)), tracker_draw]


# ------------------------------------------------------------------ rank functions (spawned)


def save_tp2_then_continue(run_dir: str):
    """TP=2: 2 steps, save, then 2 more steps: the uninterrupted trajectory."""
    layout, gpt, ddp, opt = build_tiny_trainer(tp=2, pp=1)
    losses = [train_step(layout, ddp, opt, s) for s in range(2)]
    pool = synthetic_pool_shard(50, seed=7)
    path = _save(run_dir, 2, gpt, opt, layout, pool)
    weights = full_weights(gpt, layout)
    losses += [train_step(layout, ddp, opt, s) for s in range(2, 4)]
    return {"losses": losses, "weights": weights, "path": str(path)}


def _resume(ckpt: str, tp: int, pp: int):
    layout, gpt, ddp, opt = build_tiny_trainer(tp=tp, pp=pp, seed=999)  # other seed: weights must come from disk
    loaded = load_checkpoint(ckpt, model_chunks=[gpt], model_config=TINY, optimizer=opt)
    weights = full_weights(gpt, layout)
    losses = [train_step(layout, ddp, opt, s) for s in range(2, 4)]
    result = {"weights": weights, "losses": losses, "step": loaded.step, "trainer_state": loaded.trainer_state,
              "pool": loaded.pool_shards, "config_yaml": loaded.config_yaml, "rng_restored": loaded.rng_restored}
    return result, layout, gpt, opt


def load_and_continue(ckpt: str, tp: int, pp: int, extra_ckpt: str | None = None):
    result, _layout, gpt, _opt = _resume(ckpt, tp, pp)
    if extra_ckpt is not None:
        result["extra_pool"] = load_checkpoint(extra_ckpt, model_chunks=[gpt], model_config=TINY).pool_shards
    return result


def dp2_load_save_and_restore_rng(ckpt: str, run_dir: str):
    """DP=2: resume the TP=2 checkpoint, then save with one pool shard per DP rank and check that the
    RNG streams (same layout) come back exactly after a load."""
    result, layout, gpt, opt = _resume(ckpt, tp=1, pp=1)
    pool = synthetic_pool_shard(30 + layout.dp_rank, seed=100 + layout.dp_rank)
    path = _save(run_dir, 4, gpt, opt, layout, pool)
    after_save = _rng_draws()
    _rng_draws()  # advance every stream
    loaded = load_checkpoint(path, model_chunks=[gpt], model_config=TINY, optimizer=opt)
    result.update(saved_pool=pool, saved_path=str(path), rng_after_save=after_save, rng_after_load=_rng_draws(),
                  rng_restored_same_layout=loaded.rng_restored, n_shards=len(loaded.pool_shards))
    return result


def error_cases(run_dir: str):
    """World 1: retention, corrupted pool shard, incompatible architecture, disk-space refusal."""
    layout, gpt, ddp, opt = build_tiny_trainer(tp=1, pp=1)
    out = {}
    saved = [_save(run_dir, s, gpt, opt, layout, synthetic_pool_shard(10, s), keep_last=2) for s in (1, 2, 3)]
    ckpt_dir = L.checkpoints_dir(run_dir)
    out["after_retention"] = sorted(p.name for p in ckpt_dir.iterdir())
    out["latest"] = (ckpt_dir / "latest").read_text().strip()

    corrupt = Path(run_dir) / "corrupt_copy"
    shutil.copytree(saved[-1], corrupt)
    shard = next((corrupt / "pool").glob("shard_*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    try:
        load_checkpoint(corrupt, model_chunks=[gpt], model_config=TINY, optimizer=opt)
        out["corrupt"] = None
    except CheckpointFormatError as err:
        out["corrupt"] = (str(err), str(shard))

    other = dataclasses.replace(TINY, num_layers=3, hidden_size=96, tie_word_embeddings=True)
    try:
        load_checkpoint(saved[-1], model_chunks=[gpt], model_config=other, optimizer=opt)
        out["incompatible"] = None
    except IncompatibleCheckpointError as err:
        out["incompatible"] = str(err)

    before = sorted(p.name for p in ckpt_dir.iterdir())
    real_disk_usage = shutil.disk_usage
    shutil.disk_usage = lambda path: real_disk_usage(path)._replace(free=1024)
    try:
        _save(run_dir, 4, gpt, opt, layout, synthetic_pool_shard(10, 4), keep_last=2)
        out["disk"] = None
    except InsufficientDiskSpaceError as err:
        out["disk"] = str(err)
    finally:
        shutil.disk_usage = real_disk_usage
    out["disk_dir_unchanged"] = before == sorted(p.name for p in ckpt_dir.iterdir())
    out["real_pool"] = real_pool_round_trip(str(Path(run_dir) / "real_pool"), layout, gpt, opt)
    out["weights_only"] = weights_only_round_trip(Path(run_dir), gpt, saved[-1])
    return out


def weights_only_round_trip(run_dir: Path, gpt, trainer_ckpt: Path) -> dict:
    """init_from: a weights-only checkpoint (converted-HF layout) and a full trainer checkpoint both
    load their weights into a perturbed model; a wrong architecture is refused."""
    reference = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    weights_dir = save_model_weights(run_dir / "converted", [gpt], model_config_yaml=model_config_to_yaml(TINY))
    out = {"files": sorted(p.name for p in weights_dir.iterdir())}
    for source in (weights_dir, trainer_ckpt):
        with torch.no_grad():
            for p in gpt.parameters():
                p.add_(1.0)
        load_model_weights(source, [gpt], model_config=TINY)
        out[source.name] = all(torch.equal(p, reference[n]) for n, p in gpt.named_parameters())
    try:
        load_model_weights(weights_dir, [gpt], model_config=dataclasses.replace(TINY, ffn_hidden_size=256))
        out["incompatible"] = None
    except IncompatibleCheckpointError as err:
        out["incompatible"] = str(err)
    return out


def real_pool_round_trip(run_dir: str, layout, gpt, opt) -> dict:
    """The experience pool's own state_dict through a checkpoint and back into a fresh pool."""
    from exgrpo_megatron.experience.shard import ExperienceShard
    from exgrpo_megatron.experience.types import Trajectory

    rng = np.random.default_rng(0)
    pool = ExperienceShard(group_size=8)
    for qid in range(40):
        k = int(rng.integers(0, 9))
        lengths = rng.integers(1, 30, size=k)
        trajs = [Trajectory(rng.integers(0, 128, n).astype(np.int32), rng.standard_normal(n).astype(np.float32), 3)
                 for n in lengths]
        pool.update_group(qid, k, 8, trajs)
    state = pool.state_dict()
    path = _save(run_dir, 1, gpt, opt, layout, (state["arrays"], state["meta"]))
    loaded = load_checkpoint(path, model_chunks=[gpt], model_config=TINY)
    restored = ExperienceShard(group_size=8)
    restored.load_state_dicts([{"arrays": a, "meta": m} for a, m in loaded.pool_shards])
    again = restored.state_dict()
    return {"saved": state, "restored": again, "n_questions": pool.num_questions, "retired": len(pool.retired)}


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp2run")
    return run_on_ranks(save_tp2_then_continue, 2, args=(str(run_dir),))[0] | {"run_dir": run_dir}


def _assert_same_weights(loaded: dict, reference: dict):
    assert sorted(loaded) and set(loaded) <= set(reference)
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, reference[name], err_msg=name)


def _assert_same_losses(losses, reference):
    assert len(losses) == len(reference) == 2
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (losses, reference)


def _assert_pool_equal(got, want):
    arrays, meta = got
    want_arrays, want_meta = want
    assert meta == want_meta
    assert set(arrays) == set(want_arrays)
    for name in arrays:
        assert arrays[name].dtype == want_arrays[name].dtype, name
        np.testing.assert_array_equal(arrays[name], want_arrays[name], err_msg=name)


# ------------------------------------------------------------------ tests


def test_tp2_checkpoint_resumes_at_tp1_exactly(tp2_checkpoint, tmp_path):
    (result,) = run_on_ranks(load_and_continue, 1, args=(tp2_checkpoint["path"], 1, 1))
    assert set(result["weights"]) == set(tp2_checkpoint["weights"])
    _assert_same_weights(result["weights"], tp2_checkpoint["weights"])
    _assert_same_losses(result["losses"], tp2_checkpoint["losses"][2:])
    assert result["step"] == 2
    assert result["trainer_state"] == {"step": 2, "mixed_mode": True, "sampler": {"epoch": 1, "position": 7}}
    assert result["config_yaml"] == "seed: 1234\nmodel: tiny\n"
    assert result["rng_restored"] is False  # world 2 -> 1: fresh seeding kept
    assert len(result["pool"]) == 1
    _assert_pool_equal(result["pool"][0], synthetic_pool_shard(50, seed=7))


@pytest.fixture(scope="module")
def dp2_run(tp2_checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dp2run")
    return run_on_ranks(dp2_load_save_and_restore_rng, 2, args=(tp2_checkpoint["path"], str(run_dir)))


def test_tp2_checkpoint_resumes_at_dp2_with_pool_shards_and_rng(tp2_checkpoint, dp2_run):
    for r in dp2_run:
        _assert_same_weights(r["weights"], tp2_checkpoint["weights"])
        _assert_same_losses(r["losses"], tp2_checkpoint["losses"][2:])
        assert r["n_shards"] == 2
        assert r["rng_restored"] is False  # TP=2 checkpoint, DP=2 run: different layout
        assert r["rng_restored_same_layout"] is True
        assert r["rng_after_load"] == r["rng_after_save"]


def test_tp2_checkpoint_resumes_at_pp2_and_dp2_pool_reshards_to_dp1(tp2_checkpoint, dp2_run):
    dp2_ckpt = dp2_run[0]["saved_path"]
    results = run_on_ranks(load_and_continue, 2, args=(tp2_checkpoint["path"], 1, 2, dp2_ckpt))
    merged = results[0]["weights"] | results[1]["weights"]
    assert set(merged) == set(tp2_checkpoint["weights"])
    _assert_same_weights(merged, tp2_checkpoint["weights"])
    assert results[0]["losses"] == [None, None]  # first stage reports nothing
    _assert_same_losses(results[1]["losses"], tp2_checkpoint["losses"][2:])
    # 2 shards saved by DP=2 -> both returned, in dp order, at DP=1 (PP=2)
    for r in results:
        assert len(r["extra_pool"]) == 2
        for dp_rank in range(2):
            _assert_pool_equal(r["extra_pool"][dp_rank], dp2_run[dp_rank]["saved_pool"])


def test_errors_retention_and_latest_pointer(tmp_path):
    run_dir = tmp_path / "run"
    (out,) = run_on_ranks(error_cases, 1, args=(str(run_dir),))
    assert out["after_retention"] == ["latest", "step_00000002", "step_00000003"]
    assert out["latest"] == "step_00000003"

    message, shard_path = out["corrupt"]
    assert shard_path in message and "sha256" in message
    for field in ("num_layers", "hidden_size", "tie_word_embeddings", "kv_channels"):
        assert field in out["incompatible"]
    assert "vocab_size" not in out["incompatible"] and "ffn_hidden_size" not in out["incompatible"]
    assert "1.0 KiB (1024 bytes) free" in out["disk"] and out["disk_dir_unchanged"]
    weights_only = out["weights_only"]
    assert weights_only["files"] == ["manifest.json", "model", "model_config.yaml"]
    assert weights_only["converted"] is True and weights_only["step_00000003"] is True
    assert "ffn_hidden_size" in weights_only["incompatible"]
    real = out["real_pool"]
    assert real["n_questions"] > 10 and real["retired"] > 0
    _assert_pool_equal((real["restored"]["arrays"], real["restored"]["meta"]),
                       (real["saved"]["arrays"], real["saved"]["meta"]))

    # `latest` is only a hint (pure filesystem): the newest complete step dir wins, whatever the pointer says
    # (a kill between the rename and the pointer update must not cost the newest checkpoint)
    ckpt_dir = L.checkpoints_dir(run_dir)
    (ckpt_dir / "latest").write_text("step_00000002\n")
    assert find_latest(run_dir) == ckpt_dir / "step_00000003"
    for bad in ("garbage\x00", "step_00000099", ""):
        (ckpt_dir / "latest").write_text(bad)
        assert find_latest(run_dir) == ckpt_dir / "step_00000003"
    (ckpt_dir / "latest").unlink()
    (ckpt_dir / ".tmp_step_00000009").mkdir()  # an interrupted save is never picked
    assert find_latest(run_dir) == ckpt_dir / "step_00000003"
    assert resolve_resume(run_dir, "auto") == ckpt_dir / "step_00000003"
    assert resolve_resume(run_dir, "none") is None
    assert resolve_resume(tmp_path / "elsewhere", "auto") is None
    assert resolve_resume(run_dir, str(ckpt_dir / "step_00000002")) == ckpt_dir / "step_00000002"
    assert resolve_resume(tmp_path / "elsewhere", str(run_dir)) == ckpt_dir / "step_00000003"
    with pytest.raises(FileNotFoundError):
        resolve_resume(run_dir, str(ckpt_dir / ".tmp_step_00000009"))
    # evaluate.py and tools/convert_megatron_to_hf.py take a run dir: its newest complete checkpoint
    assert L.newest_if_run_dir(str(run_dir)) == str(ckpt_dir / "step_00000003")
    assert L.newest_if_run_dir(str(ckpt_dir / "step_00000002")) == str(ckpt_dir / "step_00000002")
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="without a complete checkpoint"):
        L.newest_if_run_dir(str(tmp_path / "empty_run"))


def _start_script(mode: str, run_dir: Path, rank: int = 0, world: int = 1, port: int | None = None):
    return start_rank_process(["-m", "tests.checkpoint_worker", mode, str(run_dir)], run_dir / f"{mode}_{rank}.log",
                              rank, world, port or free_local_port())


def _finish(proc, timeout: float = 400) -> int:
    return reap(proc, timeout)


def _tail(proc) -> str:
    return log_tail([proc], 3000)


def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    killed = _start_script("kill", tmp_path)
    assert _finish(killed) == -signal.SIGKILL, _tail(killed)
    ckpt_dir = L.checkpoints_dir(tmp_path)
    tmp_dir = ckpt_dir / ".tmp_step_00000002"
    assert tmp_dir.is_dir() and not (ckpt_dir / "step_00000002").exists()
    assert any((tmp_dir / "model").iterdir())  # it died with part of checkpoint 2 on disk
    assert (ckpt_dir / "latest").read_text().strip() == "step_00000001"
    assert find_latest(tmp_path) == ckpt_dir / "step_00000001"

    resumed = _start_script("resume", tmp_path)
    assert _finish(resumed) == 0, _tail(resumed)
    report = json.loads((tmp_path / "resume_report.json").read_text())
    assert report == {"latest": "step_00000001", "step": 1, "n_shards": 1, "saved": "step_00000003"}
    assert not tmp_dir.exists()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_00000001", "step_00000003"]
    assert (ckpt_dir / "latest").read_text().strip() == "step_00000003"


def test_sigterm_on_one_rank_stops_all_ranks_after_saving(tmp_path):
    port = free_local_port()
    procs = [_start_script("preempt", tmp_path, rank=r, world=2, port=port) for r in range(2)]
    try:
        deadline = time.time() + 300
        while not all((tmp_path / f"ready_{r}").exists() for r in range(2)):
            assert time.time() < deadline and all(p.poll() is None for p in procs), _tail(procs[0]) + _tail(procs[1])
            time.sleep(0.1)
        time.sleep(0.3)
        # Only rank 0 is told, and like Slurm we signal its whole process group: the helper process that
        # dist_checkpointing's writer started at the step-0 save (rank 0 writes the DP-replicated tensors)
        # must survive it, or the preemption save fails with BrokenPipeError.
        os.killpg(procs[0].pid, signal.SIGTERM)
    finally:
        codes = [_finish(p) for p in procs]
    assert codes == [REQUEUE_EXIT_CODE] * 2, _tail(procs[0]) + _tail(procs[1])
    stopped = [json.loads((tmp_path / f"stopped_{r}.json").read_text()) for r in range(2)]
    assert stopped[0]["step"] == stopped[1]["step"] > 0
    assert stopped[0]["own_signal"] == signal.SIGTERM and stopped[1]["own_signal"] is None
    latest = find_latest(tmp_path)
    assert latest is not None and latest.name == f"step_{stopped[0]['step']:08d}"
    assert json.loads((latest / "checkpoint.json").read_text())["step"] == stopped[0]["step"]
