"""The trainer with rollout.engine=vllm generates from the policy's current weights at EVERY step:
3 steps from checkpoint.init_from, then a resume for 2 more. The rollout/trainer log-prob ratio
(mismatch/token_mult_prob_error = mean exp|logp_vllm - logp_trainer|, fp32 both sides) stays within
1 +- 0.01 at step 1 (the init_from load must reach vLLM) and at the first step after the resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "model.num_layers=2", "model.num_attention_heads=2", "model.num_query_groups=2", "model.ffn_hidden_size=256",
    "model.params_dtype=fp32", "rollout.engine=vllm", "rollout.n=4", "experience.admit_correct_at_most=3",
    "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "trainer.sft_warm_start_steps=0",
    "trainer.val_every=0", "trainer.micro_batch_max_tokens=512", "data.max_response_length=16",
    "data.num_train_examples=64", "data.num_val_examples=4", "checkpoint.save_every=3", "optim.lr=1e-3",
    "rollout.vllm.enforce_eager=true", "rollout.vllm.gpu_memory_utilization=0.05", "rollout.vllm.max_model_len=64",
    "logging.tensorboard=false", "logging.progress_bar=false", "reward.num_workers=1",
]
TOL = 0.01


def _train(run_dir: Path, hf_dir: Path, steps: int, extra: tuple = (), overrides: tuple = ()) -> str:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29000 + os.getpid() % 1000), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tests.vllm.trainer_worker", str(run_dir), str(hf_dir), *extra, "--",
           *OVERRIDES, f"trainer.total_steps={steps}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stderr


def test_vllm_rollouts_match_the_trainer_from_init_and_after_resume(tmp_path):
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    _train(run_dir, hf_dir, 3, extra=("--make-init", str(tmp_path / "init")))
    log = _train(run_dir, hf_dir, 5)
    assert "resumed from" in log and "at step 3" in log
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ratios = {int(r["step"]): r["mismatch/token_mult_prob_error"] for r in rows}
    print("token_mult_prob_error per step:", ratios)
    assert sorted(ratios) == [1, 2, 3, 4, 5]
    for step, ratio in ratios.items():
        assert abs(ratio - 1.0) <= TOL, f"step {step}: rollout/trainer log-prob ratio {ratio}"
    assert all(r["time/refit"] > 0 for r in rows)


def test_vllm_generator_one_step_ahead_generates_from_the_weights_it_was_sent(tmp_path):
    """rollout.max_staleness=1: the generator process runs vLLM on its own TP=1 copy of the policy, refitted from the
    weights the trainer sends. Step 1's rollouts come from the init_from weights (the trainer's pi_old), so their
    log-prob ratio is 1 within TOL (a generator that missed the weights would be far off); later steps are one
    update stale."""
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    _train(run_dir, hf_dir, 3, extra=("--make-init", str(tmp_path / "init")),
           overrides=("rollout.max_staleness=1", "algo.fresh_is_cap=2.0"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print("ratio, staleness per step:", [(r["mismatch/token_mult_prob_error"], r["rollout/staleness"]) for r in rows])
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert abs(rows[0]["mismatch/token_mult_prob_error"] - 1.0) <= TOL
    assert all(abs(r["mismatch/token_mult_prob_error"] - 1.0) > TOL for r in rows[1:])  # stale: older weights'


def test_vllm_rollouts_are_stored_and_replayed_with_their_own_log_probs(tmp_path):
    """In-group replay with vLLM generating: the store keeps vLLM's log-probs of each response, and a replayed token's
    weight pi_theta / pi_recorded compares the trainer's log-prob of that token with vLLM's of the SAME token. With 4
    questions, every step revisits them all, so from step 2 on every group gains stored responses; at a learning rate
    too small to move the weights, the weights are 1 within the engines' fp32 mismatch (a store whose log-probs were
    shifted by a token, or taken from another response, would be far off)."""
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    _train(run_dir, hf_dir, 3, extra=("--make-init", str(tmp_path / "init")),
           overrides=("algo.name=ingroup_replay", "experience.ingroup_size=2", "data.num_train_examples=4",
                      "optim.lr=1e-12"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print("replay token fraction, IS weight mean/max per step:",
          [(r["replay/token_fraction"], r.get("replay/is_weight_mean"), r.get("replay/is_weight_max")) for r in rows])
    assert [r["replay/token_fraction"] > 0 for r in rows] == [False, True, True]
    for r in rows[1:]:
        assert abs(r["replay/is_weight_mean"] - 1.0) <= TOL and r["replay/is_weight_max"] <= 1.0 + 5 * TOL
        assert r["generation/trajectories"] == 4 * 4  # the replayed rows are not generated
