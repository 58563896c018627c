"""Start-up refusals of `exgrpo-train` that depend on the machine, not the config's values:

* a refused start leaves no new run directory nor lock file behind, and removes nothing that was there before;
* a run directory on a filesystem without room for the run's first checkpoint exits 2 before step 1, naming the
  path, the space needed and the space free, and says what can help (not `checkpoint.keep_last`, which cannot make
  room for a first save). The nearly full disk is a real one: a 200 KiB tmpfs (needs root; skipped otherwise).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_startup_refusals.py -x
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_startup_inputs import _train
from tests.test_trainer_resume import _write_dataset


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 200 KiB filesystem (tmpfs), unmounted afterwards."""
    mount_point = tmp_path / "small_fs"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace')}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_no_room_for_the_first_checkpoint_exits_2_before_step_1(tmp_path, small_filesystem):
    data = _write_dataset(tmp_path / "train.jsonl")
    run_dir = small_filesystem / "run"
    done = _train(run_dir, data)
    # old code: trained two steps, then exit 1 at the first save ("... Free space or lower checkpoint.keep_last")
    assert done.returncode == 2, done.stderr[-3000:]
    err = done.stderr
    assert f"logging.run_dir: {run_dir}: refusing to start: the next checkpoint will not fit into {run_dir}" in err, \
        err[-3000:]
    assert "KiB" in err and "free on the filesystem of" in err and "needs about" in err and "MiB" in err, err[-3000:]
    assert "point logging.run_dir at a filesystem with more room" in err and "keep_last" not in err
    assert "Traceback" not in err
    assert not run_dir.exists()  # nothing trained, nothing written


def test_a_refused_start_leaves_no_run_directory_and_keeps_what_was_there(tmp_path):
    empty = tmp_path / "train.parquet"
    empty.write_bytes(b"")  # refused after the run directory's lock is taken (the data is read later)
    new_run_dir = tmp_path / "runs" / "new" / "run"
    done = _train(new_run_dir, str(empty))
    assert done.returncode == 2 and "not a readable parquet file" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "runs").exists()  # old code: runs/new/run/run.lock, empty
    old_run_dir = tmp_path / "old_run"
    (old_run_dir / "checkpoints").mkdir(parents=True)
    (old_run_dir / "notes.txt").write_text("mine\n")
    done = _train(old_run_dir, str(empty))
    assert done.returncode == 2, done.stderr[-3000:]
    assert sorted(p.name for p in old_run_dir.iterdir()) == ["checkpoints", "notes.txt"]
    assert (old_run_dir / "notes.txt").read_text() == "mine\n"
