"""A quiet start on CPU: the demo entry point's first lines are the start-up block, with none of megatron-core's
known-harmless "Apex / Transformer Engine not installed" warnings; the filter is by message and module, so a
real warning (or the same text raised elsewhere) still shows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from exgrpo_megatron.distributed.cpu_warnings import KNOWN_CPU_WARNINGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOWN_TEXTS = ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated")


def _run(args: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": ""}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)

EXGRPO = ("algorithm exgrpo (settings: shaping_beta=0.1, policy_shaping=True, replay_is_correction=True, "
          "replay_tis_cap=0.0, mixed_phase_clip=False)")  # its settings in effect: the paper's values



def test_demo_entry_starts_with_the_startup_block_and_no_known_warning(tmp_path):
    proc = _run(["-m", "exgrpo_megatron.train", "--config-name", "demo_cpu", "trainer.total_steps=1",
                 "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=4", "trainer.sft_warm_start_steps=0",
                 "trainer.val_every=0", "rollout.n=2", "experience.admit_correct_at_most=1",
                 "data.num_train_examples=16",
                 "checkpoint.save_every=100", "logging.progress_bar=false", f"logging.run_dir={tmp_path / 'run'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stderr + proc.stdout).splitlines()
    assert not [line for line in lines if any(t in line for t in KNOWN_TEXTS)], "\n".join(lines[:20])
    assert not [line for line in lines if "Warning" in line], "\n".join(lines[:20])  # nothing else either, today
    first = proc.stdout.splitlines()[:3]
    assert first[0].startswith("exgrpo-train: CPU run: gloo process groups, local layer spec, no Transformer Engine")
    # the demo's hidden size 128 is below the bf16 threshold: fp32 whatever the CPU, and the line says why
    assert first[1].startswith("exgrpo-train: CPU precision: fp32; ") and first[1].endswith(
        ("auto: hidden size 128 < 512", "auto: no bf16 matrix unit")), first[1]
    assert first[2].startswith(
        f"exgrpo-train: run dir {tmp_path / 'run'}; layout TP=1 PP=1 DP=1 EP=1 ETP=1 (world 1, cpu)")
    block = proc.stdout.splitlines()[3:6]
    assert block[1].startswith(
        f"exgrpo-train: {EXGRPO}; experience replay (displace): mixed phase once batch pass rate")
    assert block[2] == "exgrpo-train: rollouts: megatron engine, generated within each step from the current weights"


@pytest.mark.parametrize("overrides,algorithm,rollouts", [
    (["algo.name=grpo"], "algorithm grpo; experience replay: off (on-policy grpo)", "generated within each step"),
    (["algo.name=dapo"], "algorithm dapo; experience replay: off (on-policy dapo)", "generated within each step"),
    (["rollout.max_staleness=1", "algo.fresh_is_cap=2.0"],
     f"{EXGRPO}; experience replay (displace): mixed phase",
     "rollouts: megatron engine in its own process, generating 1 step(s) ahead of training"),
])
def test_startup_block_says_which_algorithm_runs_and_whether_generation_runs_ahead(overrides, algorithm, rollouts):
    import torch

    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import ParallelLayout
    from exgrpo_megatron.logging.startup import startup_block

    layout = ParallelLayout(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1,
                            device=torch.device("cpu"))
    cfg = load_config("demo_cpu", overrides)
    built = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    block = startup_block(cfg, layout, built).splitlines()
    lines = [line for line in block if not line.startswith("exgrpo-train: note: ")]
    assert lines[-2].startswith(f"exgrpo-train: {algorithm}") and rollouts in lines[-1], lines
    notes = [line for line in block if line.startswith("exgrpo-train: note: ")]  # the demo preset's entropy reference
    assert [n.split("=", 1)[0] for n in notes] == (  # is ExGRPO's and GRPO's: named where the variant does not use it
        [] if algorithm.startswith(("algorithm exgrpo", "algorithm grpo"))
        else ["exgrpo-train: note: algo.entropy_microbatches_ref"]), notes


SCRIPT = """
import warnings
from exgrpo_megatron.distributed import cpu_shims
cpu_shims.apply()
import megatron.core.optimizer  # warns "Transformer Engine and Apex are not installed" at import: filtered
import megatron.core.models.backends  # warns "Apex is not installed": filtered
warnings.warn("a real problem the user must see")
warnings.warn("Transformer Engine and Apex are not installed. Falling back to nothing")  # same text, not megatron
"""


def test_known_warnings_filtered_by_module_while_real_warnings_show():
    assert all(module.startswith(r"megatron\.core") for _, module in KNOWN_CPU_WARNINGS)
    proc = _run(["-c", SCRIPT])
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "UserWarning" in line]
    assert len(warned) == 2, proc.stderr
    assert "a real problem the user must see" in warned[0]
    assert "<string>" in warned[1] and "Falling back to nothing" in warned[1]
