"""What a run reads and writes around its checkpoints, on one gloo rank with the real Policy and real files:

* a changed optim.lr on resume is the LR the optimizer uses (megatron's loaded param groups kept the old
  max_lr, which its scheduler prefers), an unchanged config restores the saved LR exactly;
* the checkpoint's config against the current one: refused keys named (exit-2 ConfigError), the override
  key, one line per applied change;
* weights-only dirs (init_from, converters, the SFT cache) carry a manifest; flipped bytes or a truncated file
  are refused naming the file; a damaged SFT cache entry is rebuilt;
* disk full during a save (a real small tmpfs): the error names the path and "no space left", the partial
  save is removed, the previous checkpoint stays; a failed save's leftover does not block the next save, and
  the refusal gives real numbers.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_resume_integrity.py -x
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from exgrpo_megatron.config.loader import load_config, to_yaml
from exgrpo_megatron.config.resume_changes import check_resume_config
from exgrpo_megatron.config.validate import ConfigError, validate
from tests.helpers.multirank import run_on_ranks

TINY = ["model=tiny_qwen2", "model.params_dtype=fp32", "model.layer_spec=local", "trainer.total_steps=10",
        "optim.lr_schedule=constant"]


def _policy(overrides: list[str]):
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy

    cfg = load_config("demo_cpu", [*TINY, *overrides])
    init_distributed(1, 1, seed=cfg.seed)
    policy = Policy(cfg)
    policy.zero_grad()
    policy.optimizer.step()  # one real (zero-gradient) Adam step: the optimizer has state to save
    policy.scheduler.step(increment=3)
    return cfg, policy


def _save(run_dir: str, cfg, policy) -> Path:
    from exgrpo_megatron.checkpoint import model_config_to_yaml, save_checkpoint

    return save_checkpoint(run_dir, 3, model_chunks=policy.modules, optimizer=policy.optimizer,
                           opt_param_scheduler=policy.scheduler, trainer_state={"step": 3},
                           config_yaml=to_yaml(cfg), model_config_yaml=model_config_to_yaml(cfg.model))


def lr_after_resume(run_dir: str, new_lr: str) -> dict:
    from exgrpo_megatron.checkpoint import load_checkpoint

    cfg, policy = _policy(["optim.lr=1e-4"])
    path = _save(run_dir, cfg, policy)
    out = {}
    for lr in ("1e-4", new_lr):
        cfg2, resumed = _policy([f"optim.lr={lr}"])
        load_checkpoint(path, model_chunks=resumed.modules, model_config=cfg2.model, optimizer=resumed.optimizer,
                        opt_param_scheduler=resumed.scheduler)
        out[lr] = sorted({(g["lr"], g["max_lr"]) for g in resumed.optimizer.param_groups})
    return out


def test_a_changed_learning_rate_is_applied_on_resume(tmp_path):
    got = run_on_ranks(lr_after_resume, 1, args=(str(tmp_path), "5e-5"))[0]
    assert got["1e-4"] == [(1e-4, 1e-4)]  # unchanged config: the saved LR, as before
    assert got["5e-5"] == [(5e-5, 5e-5)]  # old code: [(1e-4, 1e-4)] while the log said 5e-05


def test_resume_refuses_keys_that_change_the_saved_states_meaning_and_names_each():
    saved = load_config("demo_cpu", [])
    changed = load_config("demo_cpu", ["algo.name=grpo", "trainer.train_batch_size=32",
                                       "trainer.ppo_mini_batch_size=16", "optim.lr=5e-5"])
    with pytest.raises(ConfigError) as err:
        check_resume_config(to_yaml(saved), changed, "ckpt")
    keys = {e.split(":", 1)[0] for e in err.value.errors[1:]}
    assert keys == {"algo.name", "trainer.train_batch_size", "trainer.ppo_mini_batch_size"}
    allowed = load_config("demo_cpu", ["algo.name=grpo", "optim.lr=5e-5", "trainer.total_steps=200",
                                       "checkpoint.allow_config_change=[algo.name]"])
    lines = check_resume_config(to_yaml(saved), allowed, "ckpt")
    assert lines == ["algo.name: 'exgrpo' -> 'grpo' (allowed by checkpoint.allow_config_change)",
                     "optim.lr: 0.0001 -> 5e-05 (applied: the optimizer and LR schedule follow this config at the "
                     "saved progress)",
                     "trainer.total_steps: 120 -> 200 (applied: the LR decay horizon follows it)"]
    assert check_resume_config(to_yaml(saved), saved, "ckpt") == []
    with pytest.raises(ConfigError, match="checkpoint.allow_config_change: 'optim.lr' is not a key"):
        validate(load_config("demo_cpu", ["checkpoint.allow_config_change=[optim.lr]"]), 1, check_paths=False)


def test_a_batch_change_on_resume_says_what_really_changes():
    saved = load_config("demo_cpu", ["trainer.train_batch_size=16", "trainer.ppo_mini_batch_size=8"])
    same_updates = load_config("demo_cpu", ["trainer.train_batch_size=8", "trainer.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError) as err:
        check_resume_config(to_yaml(saved), same_updates, "ckpt")
    text = "\n".join(err.value.errors)
    assert "from 16 prompts per step in updates of 8 to 8 in updates of 4 (still 2 optimizer updates per step" in text
    assert "no longer match" not in text  # old code: "changes optimizer updates per step" although they stay 2
    fewer_updates = load_config("demo_cpu", ["trainer.train_batch_size=16", "trainer.ppo_mini_batch_size=16"])
    with pytest.raises(ConfigError, match="so from 2 to 1 optimizer updates per step: the LR schedule's progress"):
        check_resume_config(to_yaml(saved), fewer_updates, "ckpt")


def test_a_checkpoint_config_under_renamed_keys_compares_as_the_new_names():
    """A checkpoint written before a key was renamed (config/aliases.py) resumes with no change announced for it."""
    import dataclasses

    import yaml

    cfg = load_config("demo_cpu", [])
    tree = dataclasses.asdict(cfg)
    x = tree.pop("experience")  # the pool's keys under trainer.*, the oldest names where there were two
    tree["algo"]["exp_is_correct"] = True  # ExGRPO's replay_is_correction (now algo.settings), at its default
    tree["trainer"].update(experience_start_sratio=x["delayed_start_pass_rate"], experience_lbound=x[
        "admit_correct_above"], experience_rbound=x["admit_correct_at_most"], experience_ratio=x["ratio"],
        exp_metric=x["metric"], exp_bucket_manager=x["bucket_manager"], exp_bucket_mu=x["bucket_mu"],
        exp_bucket_sigma=x["bucket_sigma"], exp_max_trajectories_per_question=x["max_trajectories_per_question"],
        exp_select_mode=x["select_mode"])
    assert check_resume_config(yaml.safe_dump(tree), cfg, "ckpt") == []


def test_a_checkpoint_config_with_the_flat_variant_settings_compares_as_the_settings():
    """A checkpoint written before algo.settings recorded cispo_eps_low/high and kl_coef as flat algo.* keys (at their
    defaults unless set): unset now, they announce no change; set now, they compare as algo.settings.*."""
    import dataclasses

    import yaml

    cfg = load_config("demo_cpu", ["algo.name=cispo"])
    tree = dataclasses.asdict(cfg)
    tree["algo"].pop("settings")
    tree["algo"].update(cispo_eps_low=None, cispo_eps_high=0.28, kl_coef=0.04)
    assert check_resume_config(yaml.safe_dump(tree), cfg, "ckpt") == []
    changed = load_config("demo_cpu", ["algo.name=cispo", "algo.settings.cispo_eps_high=0.5"])
    assert check_resume_config(yaml.safe_dump(tree), changed, "ckpt") == [
        "algo.settings.cispo_eps_high: 0.28 -> 0.5 (applied)"]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def weights_dirs_are_verified(root: str) -> dict:
    from exgrpo_megatron.checkpoint import (
        CheckpointVerificationError,
        load_model_weights,
        model_config_to_yaml,
        save_model_weights,
    )

    cfg, policy = _policy([])
    out: dict = {}
    for damage in ("flip", "truncate"):
        path = save_model_weights(Path(root) / damage, policy.modules,
                                  model_config_yaml=model_config_to_yaml(cfg.model))
        victim = max((p for p in (path / "model").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        if damage == "flip":
            _flip(victim)
        else:
            victim.write_bytes(victim.read_bytes()[:100])
        try:
            load_model_weights(path, policy.modules, model_config=cfg.model)
            out[damage] = None
        except CheckpointVerificationError as err:
            out[damage] = (str(err), str(victim))
    return out


def test_init_from_weights_are_verified_and_a_bad_file_is_named(tmp_path):
    got = run_on_ranks(weights_dirs_are_verified, 1, args=(str(tmp_path),))[0]
    for damage in ("flip", "truncate"):
        assert got[damage] is not None, f"{damage}: loaded silently"
        message, victim = got[damage]
        assert victim in message
    assert "sha256 mismatch" in got["flip"][0] and "truncated" in got["truncate"][0]


def test_an_init_from_without_a_manifest_is_refused_at_start_up(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model_config.yaml").write_text("num_layers: 2\n")
    cfg = load_config("demo_cpu", [f"checkpoint.init_from={tmp_path}", f"logging.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=f"checkpoint.init_from: '{tmp_path}': has no manifest.json"):
        validate(cfg, 1)


def sft_cache_is_rebuilt(cache: str) -> dict:
    import torch.distributed as dist

    from exgrpo_megatron.checkpoint.integrity import weights_problem
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.warm_start import warm_start_weights

    cfg = load_config("demo_cpu", [*TINY, "trainer.sft_warm_start_steps=2", f"trainer.sft_cache_dir={cache}",
                                   "data.num_train_examples=32"])
    init_distributed(1, 1, seed=cfg.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    entry = warm_start_weights(cfg, tokenizer)
    first_problem = weights_problem(entry)
    victim = max((p for p in (entry / "model").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    good = victim.read_bytes()
    _flip(victim)
    dist.barrier()
    again = warm_start_weights(cfg, tokenizer)
    return {"first": first_problem, "same_entry": again == entry, "after": weights_problem(again),
            "restored": victim.read_bytes() == good}


def test_a_damaged_sft_cache_entry_is_rebuilt(tmp_path):
    got = run_on_ranks(sft_cache_is_rebuilt, 1, args=(str(tmp_path / "sft"),))[0]
    assert got["first"] is None and got["same_entry"]
    assert got["after"] is None  # old code: the flipped file was returned (and loaded) as is
    assert got["restored"]  # the same deterministic SFT wrote the same bytes again


def sft_entry_written_twice(cache: str) -> dict:
    """Two runs trained the same entry: the second renames after the first; a killed run's staging is left."""
    import os
    import socket

    from exgrpo_megatron.checkpoint.integrity import weights_problem
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.warm_start import cache_key, train_warm_start, warm_start_weights

    cfg = load_config("demo_cpu", [*TINY, "trainer.sft_warm_start_steps=2", f"trainer.sft_cache_dir={cache}",
                                   "data.num_train_examples=32"])
    init_distributed(1, 1, seed=cfg.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    entry = Path(cache) / cache_key(cfg)
    dead = Path(cache) / f"{entry.name}.tmp-{socket.gethostname()}-999999999"  # no such process
    live = Path(cache) / f"{entry.name}.tmp-{socket.gethostname()}-{os.getppid()}"  # a run still writing
    for d in (dead, live):
        (d / "model").mkdir(parents=True)
    assert warm_start_weights(cfg, tokenizer) == entry
    train_warm_start(cfg, tokenizer, entry)  # the second run finishes after the first renamed its entry
    return {"problem": weights_problem(entry),
            "left": sorted(p.name for p in Path(cache).iterdir() if p.suffix != ".lock")}


def test_two_runs_training_the_same_sft_entry_keep_one_and_clean_only_dead_staging(tmp_path):
    got = run_on_ranks(sft_entry_written_twice, 1, args=(str(tmp_path / "sft"),))[0]
    assert got["problem"] is None  # old code: the second run's rename onto the existing entry raised
    entry = min(got["left"], key=len)
    assert got["left"] == sorted([entry, next(n for n in got["left"] if n != entry)])  # the entry + the live one's
    assert got["left"][1].startswith(f"{entry}.tmp-") and not got["left"][1].endswith("-999999999")


def sft_entry_after_waiting(cache: str) -> dict:
    import contextlib
    import io
    import time

    from exgrpo_megatron.checkpoint.integrity import weights_problem
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.warm_start import warm_start_weights

    cfg = load_config("demo_cpu", [*TINY, "trainer.sft_warm_start_steps=2", f"trainer.sft_cache_dir={cache}",
                                   "data.num_train_examples=32"])
    init_distributed(1, 1, seed=cfg.seed)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        entry = warm_start_weights(cfg, load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))
    return {"entry": str(entry), "finished": time.time(), "problem": weights_problem(entry), "stderr": err.getvalue()}


def test_a_run_waits_for_another_training_the_same_sft_entry(tmp_path):
    """A run holding the entry's lock (here this test, until the kernel lists the second run as blocked on it)
    makes a second wait; the second then trains and seals the entry once the lock is free (a first run that had
    made it would let the second just load it)."""
    import fcntl
    import os
    import threading
    import time

    from exgrpo_megatron.policy.warm_start import cache_key

    cache = tmp_path / "sft"
    cache.mkdir()
    key = cache_key(load_config("demo_cpu", [*TINY, "trainer.sft_warm_start_steps=2", f"trainer.sft_cache_dir={cache}",
                                             "data.num_train_examples=32"]))
    released: list[float] = []

    def release_once_a_run_waits(held, inode: int) -> None:
        """Close the held lock once the kernel lists a process blocked on it (/proc/locks: '-> FLOCK ...')."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(
                "->" in line and line.split()[-3].endswith(f":{inode}")
            for line in Path("/proc/locks").read_text().splitlines()):
            time.sleep(0.05)
        released.append(time.time())
        held.close()

    with open(cache / f"{key}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=release_once_a_run_waits, args=(held, os.fstat(held.fileno()).st_ino))
        waiter.start()
        got = run_on_ranks(sft_entry_after_waiting, 1, args=(str(cache),))[0]
        waiter.join()
    assert got["finished"] > released[0] and got["problem"] is None, got  # old code: trained beside the holder
    assert "another run is training the warm-start entry" in got["stderr"], got


# ------------------------------------------------------------------ disk full (a real tmpfs)


def _mount_tmpfs(path: Path, size_bytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")


def _fill(path: Path, leave_free: int) -> None:
    from exgrpo_megatron.checkpoint.disk import free_bytes

    with open(path, "wb") as fh:
        fh.write(b"\1" * max(free_bytes(path.parent) - leave_free, 0))


def disk_full_saves(mount: str) -> dict:
    import os

    from exgrpo_megatron.checkpoint import CheckpointSaveError, verify_checkpoint
    from exgrpo_megatron.checkpoint.model_state import local_param_bytes

    cfg, policy = _policy([])
    run_dir, filler = Path(mount) / "run", Path(mount) / "filler"
    out: dict = {}
    # 1. a fresh run dir: the preflight expects the parameter+Adam estimate, the real checkpoint is larger
    #    (megatron's metadata, RNG, configs): with a few KiB above the estimate free, the write itself fails
    _fill(filler, local_param_bytes(policy.modules) + (8 << 10))
    try:
        _save(str(run_dir), cfg, policy)
        out["full"] = None
    except CheckpointSaveError as err:
        out["full"] = str(err)
    out["after_full"] = sorted(os.listdir(run_dir / "checkpoints"))
    filler.unlink()
    first = _save(str(run_dir), cfg, policy)  # space freed: the retry succeeds
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    # 2. a failed save's leftover holding most of the free space: cleared before the space check
    leftover = run_dir / "checkpoints" / ".tmp_step_00000009"
    leftover.mkdir()
    _fill(leftover / "partial.bin", size // 2)
    policy.scheduler.step(increment=1)
    try:
        out["after_leftover"] = _save(str(run_dir), cfg, policy).name
    except CheckpointSaveError as err:
        out["after_leftover"] = str(err)
    # 3. too little space for another checkpoint: refused before writing, with real numbers
    _fill(filler, size // 2)
    try:
        _save(str(run_dir), cfg, policy)
        out["refused"] = None
    except CheckpointSaveError as err:
        out["refused"] = str(err)
    verify_checkpoint(first)  # the earlier checkpoint is intact throughout
    out["first"] = first.name
    return out


def test_disk_full_during_a_save_names_the_path_and_a_leftover_does_not_block_the_next(tmp_path):
    mount = tmp_path / "small_fs"
    _mount_tmpfs(mount, 24 << 20)
    try:
        got = run_on_ranks(disk_full_saves, 1, args=(str(mount),))[0]
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    assert got["full"] is not None and str(mount / "run" / "checkpoints") in got["full"]
    assert "no space left on device" in got["full"]  # old code: "basic_ios::clear: iostream error", no path
    assert got["after_full"] == []  # the partial save is removed
    assert got["after_leftover"] == "step_00000003"  # old code: refused ("0.01 GiB free ... needs about 0.01 GiB")
    assert got["refused"] is not None and "KiB (" in got["refused"] and "bytes)" in got["refused"]
