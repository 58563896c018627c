"""bench/run_processes.py: stopping the comparison bench stops its runs' whole process groups -- the bash line, the
trainer under it -- so no run keeps training unattended, and a run that saves on SIGTERM gets to save."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import run_processes as rp  # noqa: E402

SAVES_ON_SIGTERM = ("import pathlib, signal, sys, time\n"
                    "def save(*_):\n"
                    "    pathlib.Path('saved').write_text('checkpoint')\n"
                    "    sys.exit(0)\n"
                    "signal.signal(signal.SIGTERM, save)\n"
                    "pathlib.Path('started').write_text('')\n"
                    "time.sleep(300)\n")
IGNORES_SIGTERM = ("import pathlib, signal, time\n"
                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                   "pathlib.Path('started').write_text('')\n"
                   "time.sleep(300)\n")


def _start(tmp_path: Path, child: str) -> tuple:
    (tmp_path / "child.py").write_text(child)
    with open(tmp_path / "bench.log", "a") as log:
        proc = rp.start_run(f"{sys.executable} child.py && touch evaluated", str(tmp_path), dict(os.environ), log)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "bench.log").read_text()
        time.sleep(0.05)
    return proc


def test_stopping_a_run_lets_its_trainer_save_and_leaves_no_process(tmp_path):
    proc = _start(tmp_path, SAVES_ON_SIGTERM)
    assert os.getpgid(proc.pid) == proc.pid  # its own group: the bench's terminal signals do not reach it directly
    rp.stop_runs([proc], grace_s=30)
    assert (tmp_path / "saved").read_text() == "checkpoint"
    assert not (tmp_path / "evaluated").exists()  # a stopped run is not evaluated (it resumes on the next start)
    assert not rp.group_members(proc.pid)


def test_a_run_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    proc = _start(tmp_path, IGNORES_SIGTERM)
    t0 = time.monotonic()
    rp.stop_runs([proc], grace_s=1.0)
    assert time.monotonic() - t0 < 30 and not rp.group_members(proc.pid)


def test_finished_runs_are_left_alone(tmp_path):
    with open(tmp_path / "bench.log", "a") as log:
        proc = rp.start_run("true", str(tmp_path), dict(os.environ), log)
    proc.wait()
    rp.stop_runs([proc], grace_s=1.0)  # no signal to a group that is gone
    assert proc.returncode == 0
