"""Start-up around the run directory, with real processes and files:

* the run-directory lock: a live holder makes a second `exgrpo-train` exit 2 naming it (before the model or any
  file), a SIGKILLed holder leaves no obstacle (a requeue after a crash starts);
* the run directory must be a writable directory (a regular file, a read-only filesystem: exit 2 naming
  logging.run_dir), and checkpoints/latest a file;
* two single-process runs on one machine rendezvous on different free ports;
* a damaged token-cache entry is rebuilt; a .json data file with a non-UTF-8 byte is named.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_run_dir_lock.py -x
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exgrpo_megatron.distributed.run_lock import RunDirError, acquire_run_dir

REPO = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time\nfrom exgrpo_megatron.distributed.run_lock import acquire_run_dir\n"
        "lock = acquire_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(120)")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR",
                                                            "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _train(run_dir: Path | str, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """exgrpo-train on the demo preset: exits 2 at start-up in every case here, long before training."""
    return subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", f"logging.run_dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)


def test_a_second_trainer_on_a_held_run_dir_exits_2_naming_the_holder(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunDirError, match=f"pid {holder.pid} on host"):
            acquire_run_dir(tmp_path / "run")
        started = time.perf_counter()
        done = _train(tmp_path / "run")  # old code: no lock, the demo run starts training beside the holder
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"pid {holder.pid}" in done.stderr and "logging.run_dir" in done.stderr
        assert time.perf_counter() - started < 120
        assert sorted(os.listdir(tmp_path / "run")) == ["run.lock"]  # nothing written by the refused launch
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_trainer_does_not_block_the_requeue(tmp_path):
    holder = _holder(tmp_path / "run")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / "run" / "run.lock").read_text())["pid"] == holder.pid  # the stale record
    lock = acquire_run_dir(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()
    acquire_run_dir(tmp_path / "run").release()  # released: taken again


def test_an_unusable_run_dir_exits_2_at_start_up(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    done = _train(a_file)
    assert done.returncode == 2 and "logging.run_dir" in done.stderr and "not a directory" in done.stderr
    latest_dir = tmp_path / "run" / "checkpoints" / "latest"
    latest_dir.mkdir(parents=True)
    done = _train(tmp_path / "run")
    assert done.returncode == 2 and f"{latest_dir} is a directory" in done.stderr
    read_only = tmp_path / "ro"
    read_only.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({mounted.stderr.strip()})")
    try:
        done = _train(read_only / "run")
    finally:
        subprocess.run(["umount", str(read_only)], check=False)
    assert done.returncode == 2 and "logging.run_dir" in done.stderr and "not writable" in done.stderr


RENDEZVOUS = ("import time\nfrom exgrpo_megatron.distributed.runtime import init_distributed, destroy_distributed\n"
              "init_distributed(1, 1); print('up', flush=True); time.sleep(8); destroy_distributed()")


def test_two_single_process_runs_on_one_machine_do_not_collide_on_the_port():
    procs = []
    for _ in range(2):
        procs.append(subprocess.Popen([sys.executable, "-c", RENDEZVOUS], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=_env()))
        time.sleep(4)  # the first holds its store while the second starts (old code: both on 29500)
    results = [(p.wait(timeout=300), p.stdout.read() if p.stdout else "", p.stderr.read() if p.stderr else "")
               for p in procs]
    for code, out, err in results:
        assert code == 0 and "up" in out, err[-2000:]


def test_a_free_port_is_drawn_below_the_ephemeral_range_where_connections_cannot_take_it():
    """The OS gives outgoing connections (gloo opens many) ports from its ephemeral range: a port found free there
    could be taken before the store binds it (seen with three test workers: EADDRINUSE at rank 0's store)."""
    import socket

    from exgrpo_megatron.distributed.launch_env import ephemeral_port_low, free_local_port

    low = ephemeral_port_low()
    ports = {free_local_port() for _ in range(20)}
    if low:  # Linux
        assert all(1024 <= p < low for p in ports), (low, sorted(ports))  # old code: the OS's pick, from the range
        assert len(ports) > 1  # drawn at random: two runs starting together rarely try the same one
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_damaged_token_cache_entry_is_rebuilt(tmp_path):
    from exgrpo_megatron.data.token_cache import cached_prompt_dataset
    from exgrpo_megatron.data.tokenizer import CharTokenizer

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "reward_model": {"ground_truth": str(i + 1)}})
                            + "\n" for i in range(20)))
    kw = dict(cache_dir=str(tmp_path / "cache"), tokenizer=CharTokenizer(), template="plain", max_prompt_length=40)
    first = cached_prompt_dataset(str(data), **kw)
    (entry,) = (tmp_path / "cache").glob("*.npz")
    for damage in ("flip", "truncate"):
        raw = bytearray(entry.read_bytes())
        if damage == "flip":
            raw[len(raw) // 2] ^= 0xFF
        else:
            raw = raw[: len(raw) // 3]
        entry.write_bytes(bytes(raw))
        again = cached_prompt_dataset(str(data), **kw)  # old code: BadZipFile / zlib.error stopped the run
        assert [e.prompt_ids for e in again] == [e.prompt_ids for e in first]
        assert [e.prompt_ids for e in cached_prompt_dataset(str(data), **kw)] == [e.prompt_ids for e in first]


def test_a_json_data_file_with_a_bad_byte_is_named(tmp_path):
    from exgrpo_megatron.data.datasets import DataFileError, load_prompt_dataset
    from exgrpo_megatron.data.tokenizer import CharTokenizer

    path = tmp_path / "rows.json"
    path.write_bytes(b'[{"prompt": "What is 1+1? \xff", "reward_model": {"ground_truth": "2"}}]')
    with pytest.raises(DataFileError, match=f"{path}: not valid UTF-8 \\(byte 26"):
        load_prompt_dataset(str(path), tokenizer=CharTokenizer(), template="plain", max_prompt_length=40)


def test_a_latest_pointer_replaced_by_a_directory_does_not_fail_a_published_save(tmp_path, capsys):
    from exgrpo_megatron.checkpoint import layout as L

    ckpt_dir = tmp_path / "checkpoints"
    (ckpt_dir / "latest").mkdir(parents=True)  # old code: IsADirectoryError after the checkpoint was published
    L.update_latest_pointer(ckpt_dir, "step_00000004")
    assert "could not be updated" in capsys.readouterr().err
    (ckpt_dir / "latest").rmdir()
    L.update_latest_pointer(ckpt_dir, "step_00000004")
    assert (ckpt_dir / "latest").read_text() == "step_00000004\n"
