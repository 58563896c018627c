"""algo.old_logprobs: where pi_old comes from (policy/old_logprobs.py), and that the selection pass's current-policy
log-probs of the chosen trajectory travel with the replay choice (single process and DP=2)."""

from __future__ import annotations

import numpy as np
import pytest

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.pi_old_source import resolve_old_logprobs, resolve_old_logprobs_for, rollout_logprobs_exact
from exgrpo_megatron.config.validate import all_errors, config_errors
from exgrpo_megatron.experience.selection import choose_trajectories
from exgrpo_megatron.experience.sharded import ShardedExperiencePool
from exgrpo_megatron.experience.types import CandidateScores, GroupOutcome, as_trajectory
from tests.helpers.multirank import run_on_ranks


@pytest.mark.parametrize(("engine", "dtype", "top_p", "top_k", "exact"), [
    ("megatron", "float32", 1.0, -1, True),     # the policy's own modules and dtype
    ("megatron", "float32", 0.9, 20, True),     # its log-probs are the full softmax at T regardless
    ("megatron", "bfloat16", 1.0, -1, False),   # bf16 KV-cache decode vs the packed forward
    ("vllm", "bfloat16", 1.0, -1, False),       # bf16 vLLM vs the trainer's forward
    ("vllm", "float32", 1.0, -1, True),
    ("vllm", "float32", 0.9, -1, False),        # top-p renormalisation differs across vLLM versions
    ("vllm", "float32", 1.0, 50, False),
])
def test_which_generation_logprobs_are_exact(engine, dtype, top_p, top_k, exact):
    assert rollout_logprobs_exact(engine, dtype, top_p, top_k) is exact


@pytest.mark.parametrize(("mode", "exact", "updates", "expected"), [
    ("auto", True, 1, "rollout"),
    ("auto", True, 2, "rollout"),
    ("auto", False, 1, "training_forward"),  # the one update's own forward runs on pi_old's weights
    ("auto", False, 2, "recompute"),         # the second update's would not
    ("recompute", True, 1, "recompute"),
    ("rollout", True, 2, "rollout"),
    ("training_forward", True, 1, "training_forward"),
])
def test_resolution(mode, exact, updates, expected):
    assert resolve_old_logprobs(mode, exact, updates) == expected


def test_sources_a_run_cannot_honour_fail_at_start_up_naming_the_key():
    assert config_errors(load_config("demo_cpu", []), 1) == []
    bf16_vllm = ["rollout.engine=vllm", "rollout.vllm.dtype=bf16", "model.hf_path=/x"]
    bf16_megatron = ["model.params_dtype=bf16"]
    two_updates = ["trainer.train_batch_size=8", "trainer.ppo_mini_batch_size=4"]
    for overrides in (["algo.old_logprobs=rollout", *bf16_vllm], ["algo.old_logprobs=rollout", *bf16_megatron],
                      ["algo.old_logprobs=training_forward", *two_updates], ["algo.old_logprobs=cached"]):
        errors = config_errors(load_config("demo_cpu", overrides), 1)
        assert len(errors) == 1 and errors[0].startswith("algo.old_logprobs"), errors


def test_the_resolved_source_follows_precision_engine_and_updates_per_step():
    def source(*overrides: str) -> str:
        return resolve_old_logprobs_for(load_config("demo_cpu", ["model.params_dtype=fp32", *overrides]))

    one = ["trainer.train_batch_size=8", "trainer.ppo_mini_batch_size=8"]
    two = ["trainer.train_batch_size=8", "trainer.ppo_mini_batch_size=4"]
    assert source(*one) == "rollout" and source(*two) == "rollout"
    assert source("model.params_dtype=bf16", *one) == "training_forward"
    assert source("model.params_dtype=bf16", *two) == "recompute"
    ahead = ["rollout.max_staleness=1", "algo.fresh_is_cap=2"]
    assert source(*ahead, *one) == "training_forward" and source(*ahead, *two) == "recompute"
    # two passes over the rollouts: the second pass's updates run on changed weights, as a second mini-batch's do
    assert source("model.params_dtype=bf16", *one, "trainer.update_epochs=2") == "recompute"
    assert source(*one, "trainer.update_epochs=2") == "rollout"


def test_update_epochs_refused_with_the_training_forward_and_out_of_range_naming_the_key():
    one = ["trainer.train_batch_size=8", "trainer.ppo_mini_batch_size=8"]
    assert config_errors(load_config("demo_cpu", [*one, "algo.old_logprobs=training_forward"]), 1) == []
    errors = config_errors(load_config("demo_cpu", [*one, "algo.old_logprobs=training_forward",
                                                    "trainer.update_epochs=2"]), 1)
    assert len(errors) == 1 and errors[0].startswith("trainer.update_epochs:"), errors
    assert config_errors(load_config("demo_cpu", [*one, "trainer.update_epochs=2"]), 1) == []
    errors = all_errors(load_config("demo_cpu", ["trainer.update_epochs=0"]), 1, check_paths=False)
    assert errors and all(e.startswith("trainer.update_epochs") for e in errors), errors


def _traj(tokens: list[int], step: int = 0):
    return as_trajectory(np.array(tokens), np.full(len(tokens), -1.0), step)


def _lp_scorer(qids, candidates):
    """Entropy = the first token id; token log-probs = -(token id) / 10, so which candidate's came back is visible."""
    return [CandidateScores(mean_entropy=np.array([float(t.token_ids[0]) for t in c]),
                            token_logprobs=[-t.token_ids.astype(np.float32) / 10 for t in c]) for c in candidates]


def test_the_chosen_candidates_logprobs_come_back_with_it():
    rng = np.random.default_rng(0)
    cands = [[_traj([5, 1]), _traj([2, 7, 1]), _traj([9, 1])], [_traj([3, 1])]]
    (t0, lp0), (t1, lp1) = choose_trajectories([10, 11], cands, "ent", _lp_scorer, rng)
    assert t0.token_ids.tolist() == [2, 7, 1] and lp0.tolist() == pytest.approx([-0.2, -0.7, -0.1])
    assert t1.token_ids.tolist() == [3, 1] and lp1 is None  # one candidate: not scored, the trainer runs it forward
    (t, lp), _ = choose_trajectories([10, 11], cands, "random", _lp_scorer, rng)
    assert lp is None  # random selection runs no forward pass


def _pool_sample(dp: int) -> list[tuple[int, list[int], list[float] | None]]:
    import torch.distributed as dist

    if dp > 1:
        dist.init_process_group("gloo")
    pool = ShardedExperiencePool(4, dp_group=dist.group.WORLD if dp > 1 else None)
    rank = dist.get_rank() if dp > 1 else 0
    outcomes = [GroupOutcome(q, 2, 4, [np.array([q % 7 + 2, q, 1]), np.array([q % 5 + 1, 1])],
                             [np.full(3, -1.0), np.full(2, -1.0)], step=1) for q in range(rank, 12, dp)]
    pool.update(outcomes)
    return [(c.qid, c.trajectory.token_ids.tolist(), None if c.current_logprobs is None else
             c.current_logprobs.tolist()) for c in pool.sample(6, 3, _lp_scorer)]


def test_pool_choices_carry_the_current_logprobs_across_dp_ranks():
    one = run_on_ranks(_pool_sample, 1, args=(1,))[0]
    two = run_on_ranks(_pool_sample, 2, args=(2,))
    assert two[0] == two[1]  # every rank gets every choice with its log-probs, whichever rank scored it
    for choices in (one, two[0]):
        assert len(choices) == 6
        for _, tokens, lps in choices:
            assert lps == pytest.approx([-t / 10 for t in tokens])


def test_a_train_batch_is_built_complete_with_its_pi_old_and_frozen():
    import dataclasses

    import torch

    from exgrpo_megatron.policy.train_batch import RolloutRows, TrainBatch

    rows = RolloutRows([[1, 2, 3], [4, 5]], [1, 1], [torch.zeros(2), torch.zeros(1)], [1.0, 0.0], [0.5, -0.5],
                       [False, True], [0, 0])
    batch = TrainBatch.of(rows, [torch.ones(2), torch.ones(1)])
    assert batch.response_lengths == rows.response_lengths == [2, 1]
    assert batch.behaviour_logprobs is rows.behaviour_logprobs and batch.is_replay == [False, True]
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.old_logprobs = []  # type: ignore[misc]
    with pytest.raises(ValueError, match="pi_old of 1 rows for a batch of 2"):
        TrainBatch.of(rows, [torch.ones(2)])
