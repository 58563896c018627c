"""SIGTERM at several moments of start-up (config, process groups, model/grader built, checkpoint being
loaded, and from outside at once) exits with the requeue code 75 and leaves no partial state: the
run's checkpoint verifies and is unchanged, nothing is moved aside, no temp files are left.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_startup_preemption.py
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from exgrpo_megatron.distributed.launch_env import free_local_port
from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE
from tests.helpers.rank_processes import log_tail, reap, start_rank_process
from tests.test_trainer_resume import _overrides, _write_dataset

TIMEOUT_S = 400


def _train_args(run_dir: Path, data: str) -> list[str]:
    return ["--config-name", "demo_cpu", f"logging.run_dir={run_dir}", *_overrides(data, 1)]


def _start(point: str, run_dir: Path, data: str, tag: str):
    return start_rank_process(["-m", "tests.startup_signal_worker", point, "--", *_train_args(run_dir, data)],
                              run_dir.parent / f"{tag}.log", 0, 1, free_local_port())


def _snapshot(run_dir: Path) -> dict[str, int]:
    """Every file under the run dir (path -> size), metrics and run config included."""
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run dir holding one complete checkpoint (step 1)."""
    root = tmp_path_factory.mktemp("startup")
    data = _write_dataset(root / "train.jsonl")
    run_dir = root / "run"
    proc = _start("none", run_dir, data, "first")
    assert reap(proc, TIMEOUT_S) == 0, log_tail([proc])
    assert (run_dir / "checkpoints" / "step_00000001" / "checkpoint.json").is_file()
    return {"run_dir": run_dir, "data": data, "before": _snapshot(run_dir)}


@pytest.mark.parametrize("point", ["config", "distributed", "components", "resume"])
def test_sigterm_during_startup_exits_75_and_changes_nothing(trained, point):
    run_dir = trained["run_dir"]
    proc = _start(point, run_dir, trained["data"], point)
    code = reap(proc, TIMEOUT_S)
    log = proc.log_path.read_text()
    assert code == REQUEUE_EXIT_CODE, log_tail([proc])
    assert "preempted during start-up by signal 15" in log
    after = _snapshot(run_dir)
    # the run config may be re-written (atomically, same content) once start-up got that far; nothing else
    assert {k: v for k, v in after.items() if k != "config.yaml"} == \
        {k: v for k, v in trained["before"].items() if k != "config.yaml"}
    assert not any(".tmp" in name for name in after)
    ckpt = json.loads((run_dir / "checkpoints" / "step_00000001" / "checkpoint.json").read_text())
    assert ckpt["step"] == 1


def _catches_sigterm(pid: int) -> bool:
    """Linux: the process has a handler for SIGTERM (bit 15 of SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def test_sigterm_from_outside_as_soon_as_the_handler_is_there_exits_75(tmp_path, trained):
    """The handler is installed before the heavy imports (torch, megatron, hydra), so a SIGTERM sent the
    moment it is there arrives while Python is still importing; it exits 75 and writes nothing."""
    run_dir = tmp_path / "fresh"
    proc = _start("none", run_dir, trained["data"], "outside")
    deadline = time.time() + 60
    while not _catches_sigterm(proc.pid):
        assert proc.poll() is None and time.time() < deadline, log_tail([proc])
        time.sleep(0.005)
    assert "torch" not in Path(f"/proc/{proc.pid}/maps").read_text()  # torch's libraries are not loaded yet
    proc.send_signal(signal.SIGTERM)
    code = reap(proc, TIMEOUT_S)
    assert code == REQUEUE_EXIT_CODE, log_tail([proc])
    assert not (run_dir / "checkpoints").exists()


def test_data_set_without_usable_rows_exits_2_at_startup_with_counts(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\xff\xfe\n{not json\n" + b'{"prompt": "q"}\n')
    run_dir = tmp_path / "run"
    proc = _start("none", run_dir, str(data), "empty")
    code = reap(proc, TIMEOUT_S)
    log = proc.log_path.read_text()
    assert code == 2, log_tail([proc])
    assert f"no usable row in ['{data}'] (3 rows read)" in log
    assert "1 malformed: not valid UTF-8" in log and "1 malformed: JSON decode error" in log
    assert "1 malformed: missing field 'reward_model'" in log
    assert not (run_dir / "checkpoints").exists()
