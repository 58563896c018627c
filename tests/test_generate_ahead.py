"""Generating ahead of training (`rollout.max_staleness` = 1) through the real training loop: a generator process
(its own TP=1 copy of the policy, the megatron engine, its grader) linked to the trainer's rank 0 over gloo.

* lockstep: two runs give the same metrics and checkpoints bitwise, and the logged staleness is the schedule's
  (0 at step 1, then 1);
* a clean stop (total_steps=3, then extended), a SIGKILL halfway through a save, and a SIGKILL at a random moment
  of training all resume to the uninterrupted run's metrics and final checkpoint, bitwise (the in-flight plan and
  rollouts are saved with the checkpoint);
* a TP=2 trainer feeding the same generator trains on exactly the TP=1 trainer's first two steps' rollouts
  (both from the initial weights, gathered from the TP shards) and then stays close;
* start-up refuses generating ahead without a truncated-IS cap (exit 2 naming algo.fresh_is_cap).

Staleness 0 is the colocated step, guarded bitwise by tests/test_demo_bitwise.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exgrpo_megatron.checkpoint import find_latest
from exgrpo_megatron.logging import read_metrics
from tests.test_trainer_resume import (
    TIMEOUT_S,
    _assert_same_tensors,
    _ckpt,
    _comparable,
    _finish,
    _json,
    _launch,
    _logs,
    _model_tensors,
    _overrides,
    _train,
    _write_dataset,
)

N_STEPS = 6
AHEAD = ("rollout.max_staleness=1", "algo.fresh_is_cap=2.0")


def _ahead_overrides(data: str, total_steps: int, tp: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    return _overrides(data, total_steps, tp=tp, extra=(*AHEAD, *extra))


def _metrics(run_dir: Path) -> list[dict]:
    return read_metrics(str(run_dir / "metrics.jsonl"))


def _assert_same_run(run_dir: Path, reference: dict, scratch: Path) -> None:
    got, want = _metrics(run_dir), reference["metrics"]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert _comparable(g) == _comparable(w), f"step {w['step']} differs"
    a, b = _ckpt(run_dir, N_STEPS), _ckpt(reference["run_dir"], N_STEPS)
    _assert_same_tensors(_model_tensors(a, scratch), _model_tensors(b, scratch))
    for name in ("trainer_state.json", "opt_param_scheduler.json"):  # trainer state: the plan + rollouts in flight
        assert _untimed(_json(a / "state" / name)) == _untimed(_json(b / "state" / name)), name


def _untimed(tree: object) -> object:
    """The tree without wall-clock fields (`*_seconds`: the generator's timings of the rollouts in flight)."""
    if isinstance(tree, dict):
        return {k: _untimed(v) for k, v in tree.items() if not k.endswith("_seconds")}
    if isinstance(tree, list):
        return [_untimed(v) for v in tree]
    return tree


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_ahead")
    data = _write_dataset(root / "train.jsonl")
    run_dir, init = root / "reference", root / "init"
    _train(run_dir, _ahead_overrides(data, N_STEPS), worker_args=("--make-init", str(init)))
    metrics = _metrics(run_dir)
    assert [r["rollout/staleness"] for r in metrics] == [0.0] + [1.0] * (N_STEPS - 1)
    assert metrics[0]["reward/mean"] > 0 and sum(r["experience/n_replayed"] for r in metrics) >= 2
    assert any(r["mismatch/token_mult_prob_error"] > 1.0 for r in metrics[1:])  # stale: pi_old != behaviour
    in_flight = _json(_ckpt(run_dir, N_STEPS) / "state" / "trainer_state.json")["ahead"]["in_flight"]
    assert [e["step"] for e in in_flight] == [N_STEPS + 1] and in_flight[0]["result"]["weights_step"] == N_STEPS - 1
    return {"root": root, "data": data, "init": init, "run_dir": run_dir, "metrics": metrics}


def test_lockstep_runs_are_bitwise_equal(reference, tmp_path):
    run_dir = tmp_path / "again"
    _train(run_dir, _ahead_overrides(reference["data"], N_STEPS, extra=(f"checkpoint.init_from={reference['init']}",)))
    _assert_same_run(run_dir, reference, tmp_path)


def test_stopped_and_killed_mid_save_resume_bitwise(reference, tmp_path):
    data, run_dir = reference["data"], tmp_path / "interrupted"
    init = (f"checkpoint.init_from={reference['init']}",)
    _train(run_dir, _ahead_overrides(data, 3, extra=init), tag="a")  # a clean stop after step 3
    assert find_latest(run_dir) == _ckpt(run_dir, 3)
    log = _train(run_dir, _ahead_overrides(data, N_STEPS, extra=init), worker_args=("--kill-in-save", "4"),
                 expect=-signal.SIGKILL, tag="b")
    assert f"resumed from {_ckpt(run_dir, 3)} at step 3" in log and find_latest(run_dir) == _ckpt(run_dir, 3)
    _train(run_dir, _ahead_overrides(data, N_STEPS, extra=init), tag="c")
    _assert_same_run(run_dir, reference, tmp_path)


def test_sigkill_at_a_random_moment_resumes_bitwise(reference, tmp_path):
    run_dir = tmp_path / "killed"
    overrides = _ahead_overrides(reference["data"], N_STEPS, extra=(f"checkpoint.init_from={reference['init']}",))
    procs = _launch(run_dir, overrides, tag="killed")
    deadline = time.time() + TIMEOUT_S
    try:
        while not _ckpt(run_dir, 2).exists():
            assert time.time() < deadline and procs[0].poll() is None, _logs(procs)
            time.sleep(0.01)
        time.sleep(random.Random(os.getpid()).uniform(0.0, 1.5))  # anywhere in steps 3-4: training or waiting
        os.kill(procs[0].pid, signal.SIGKILL)
    finally:
        _finish(procs)
    _train(run_dir, overrides, tag="resume")
    _assert_same_run(run_dir, reference, tmp_path)


def test_tp2_trainer_trains_on_the_same_first_rollouts(reference, tmp_path):
    run_dir = tmp_path / "tp2"
    _train(run_dir, _ahead_overrides(reference["data"], 4, tp=2, extra=(f"checkpoint.init_from={reference['init']}",)),
           world=2)
    got, want = _metrics(run_dir), reference["metrics"]
    for step in (0, 1):  # both generated from the initial weights: the same rollouts, whatever the trainer's TP
        for key in ("reward/mean", "response_length/mean", "experience/n_replayed"):
            assert got[step][key] == want[step][key], (step, key)
    for g, w in zip(got[2:], want[2:4], strict=True):
        assert g["rollout/staleness"] == 1.0 and abs(g["reward/mean"] - w["reward/mean"]) <= 0.25


def test_generating_ahead_without_an_is_cap_or_with_rollout_logprobs_is_refused(tmp_path):
    for extra, named in ((["rollout.max_staleness=1"], "algo.fresh_is_cap"),
                         (["rollout.max_staleness=1", "algo.fresh_is_cap=2", "algo.name=dapo"], "algo.name: dapo"),
                         (["rollout.max_staleness=1", "algo.fresh_is_cap=2", "algo.old_logprobs=rollout"],
                          "algo.old_logprobs")):
        done = subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu",
                               f"logging.run_dir={tmp_path / 'run'}", *extra], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 2 and named in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_start_up_checks_name_each_key():
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.config.validate import config_errors

    def errors(*overrides: str) -> str:
        return "\n".join(config_errors(load_config("demo_cpu", list(overrides)), 1))

    assert errors(*AHEAD) == ""
    assert "algo.fresh_is_cap" in errors("rollout.max_staleness=1")
    assert "rollout.generator.cpu_cores" in errors(*AHEAD, "rollout.generator.cpu_cores=[4096]")
    assert "rollout.generator.device" in errors(*AHEAD, "rollout.generator.device=tpu")
    assert errors("algo.name=dapo") == ""  # colocated: everything as before


def test_weights_load_by_name_and_copy_the_vocabulary_rows_both_have():
    import torch

    from exgrpo_megatron.training.async_generation.generator import load_full_weights

    params = {"embedding.word_embeddings.weight": torch.nn.Parameter(torch.zeros(128, 4)),
              "decoder.final_layernorm.weight": torch.nn.Parameter(torch.zeros(4))}
    sent = torch.arange(256 * 4, dtype=torch.float32).view(256, 4)  # the trainer's TP padded the vocabulary further
    load_full_weights(params, [("embedding.word_embeddings.weight", sent),
                               ("decoder.final_layernorm.weight", torch.ones(4))])
    assert torch.equal(params["embedding.word_embeddings.weight"], sent[:128])
    assert torch.equal(params["decoder.final_layernorm.weight"], torch.ones(4))
    with pytest.raises(ValueError, match="decoder.final_layernorm.weight"):
        load_full_weights(params, [("decoder.final_layernorm.weight", torch.ones(5, 2))])
