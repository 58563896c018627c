"""Issue 15, item 6: each piece of the replay path re-checked against the paper and the original code, on the code
the trainer runs (ExGRPO's pool hook through trainer.pool_outcomes, policy.train_batch.build_rollout_rows with its
advantages, data.step_plan.compose_step, the pool): what is stored and when, which log-probs a replayed row
carries, the sign and size of its advantage, and how fast solved questions leave the fresh stream."""

from __future__ import annotations

import numpy as np
import pytest

from exgrpo_megatron.algo.variants.exgrpo import ExGRPO
from exgrpo_megatron.config.schema import AlgoConfig, TrainerConfig
from exgrpo_megatron.data.sampler import PromptSampler
from exgrpo_megatron.data.step_plan import QuestionGroup, compose_step
from exgrpo_megatron.data.synthetic import build_arithmetic_prompt_dataset
from exgrpo_megatron.data.tokenizer import load_tokenizer
from exgrpo_megatron.experience import ShardedExperiencePool, Trajectory
from exgrpo_megatron.policy.train_batch import build_rollout_rows
from exgrpo_megatron.rollout.group_filter import StepRollouts
from exgrpo_megatron.rollout.splice import splice_replay
from exgrpo_megatron.rollout.types import Sample
from exgrpo_megatron.training.trainer import pool_outcomes

K = 8
PROMPT = [5, 6, 7]
EXGRPO = ExGRPO.from_config("exgrpo", AlgoConfig(), TrainerConfig(), max_response_length=16)


def group_outcomes(groups, samples, rewards, step: int, collect: bool):
    """What the trainer hands the pool for these graded groups (ExGRPO's pool hook)."""
    return pool_outcomes(EXGRPO, StepRollouts.unfiltered(list(groups), samples, rewards), step, collect)


def fresh(i: int, logprob: float = -0.25) -> Sample:
    return Sample(PROMPT, [10 + i, 11 + i, 2], [logprob] * 3, "eos")


def replay_group(k_fresh_correct: int) -> tuple[QuestionGroup, list[Sample], list[float], Trajectory]:
    stored = Trajectory(np.array([40, 41, 2], np.int32), np.array([-1.5, -2.5, -0.5], np.float32), step=3)
    group = QuestionGroup(7, PROMPT, "1", replay=stored, bucket=4)
    samples = splice_replay([fresh(i) for i in range(K - 1)], PROMPT, stored.token_ids.tolist(),
                            stored.logprobs.tolist())
    rewards = [1.0] * k_fresh_correct + [0.0] * (K - 1 - k_fresh_correct) + [1.0]  # the replay is correct
    return group, samples, rewards, stored


def test_warm_up_collects_nothing_but_retires_solved_questions():
    """[C] §1.2/§1.5: no collection before the mixed switch (k only, no trajectory); k == K retires from step 1."""
    groups = [QuestionGroup(1, PROMPT, "1"), QuestionGroup(2, PROMPT, "1")]
    samples = [[fresh(i) for i in range(K)] for _ in groups]
    rewards = [[1.0] * K, [1.0] * 3 + [0.0] * 5]
    out = group_outcomes(groups, samples, rewards, step=1, collect=False)
    assert [(o.qid, o.k_correct, len(o.correct_token_ids)) for o in out] == [(1, K, 0), (2, 3, 0)]
    pool = ShardedExperiencePool(K)
    pool.update(out)
    assert pool.retired_ids() == {1} and pool.shard.num_questions == 0
    out = group_outcomes(groups, samples, rewards, step=2, collect=True)
    assert [(o.qid, o.k_correct, len(o.correct_token_ids)) for o in out] == [(1, K, K), (2, 3, 3)]


@pytest.mark.parametrize("k_fresh", [0, 3, 6, 7])
def test_replayed_row_keeps_recorded_logprobs_and_gets_one_minus_k_over_k(k_fresh):
    """§2: the replay is the K-th member, k counts it, A(o*) = 1 - k/K >= 0 (Dr.GRPO, no std), and its row carries
    the log-probs recorded at collection (pi_past), not this step's."""
    group, samples, rewards, stored = replay_group(k_fresh)
    batch = build_rollout_rows([samples], [rewards], EXGRPO.advantages)
    k = k_fresh + 1
    assert batch.is_replay == [False] * (K - 1) + [True]
    assert batch.advantages[-1] == pytest.approx(1 - k / K)
    assert batch.advantages[-1] >= 0
    wrong = [a for a, r, rep in zip(batch.advantages, batch.rewards, batch.is_replay, strict=True) if r == 0]
    assert all(a == pytest.approx(-k / K) for a in wrong)
    np.testing.assert_array_equal(batch.behaviour_logprobs[-1].numpy(), stored.logprobs)
    out = group_outcomes([group], [samples], [rewards], step=9, collect=True)[0]
    assert out.k_correct == k
    # the stored trajectory comes back with its ORIGINAL log-probs, so dedup keeps the first record
    pool = ShardedExperiencePool(K)
    pool.update(group_outcomes([group], [samples], [rewards], step=3, collect=True))
    pool.update([out])
    if k < K:
        cands = pool.shard.candidates(7)
        assert sum(c.same_tokens(stored) for c in cands) == 1
        assert pool.shard.bucket_of(7) == k


def test_a_solved_question_leaves_the_fresh_stream_and_the_pool_at_once():
    """§1.5 (and sampler.py's documented deviation: retired ids are skipped immediately, not at epoch end)."""
    tok = load_tokenizer("char", None)
    data = build_arithmetic_prompt_dataset(16, seed=0, tokenizer=tok)
    pool = ShardedExperiencePool(K)
    group = QuestionGroup(3, data[3].prompt_ids, data[3].answer)
    samples = [[fresh(i) for i in range(K)]]
    pool.update(group_outcomes([group], samples, [[1.0] * 3 + [0.0] * 5], step=1, collect=True))
    assert 3 in pool.shard
    pool.update(group_outcomes([group], samples, [[1.0] * K], step=2, collect=True))
    assert 3 not in pool.shard and 3 in pool.retired_ids()
    sampler = PromptSampler(data.qids(), seed=0)
    seen = []
    for step in range(6):
        groups = compose_step(data, sampler, pool, replay_on=True, batch_size=8, experience_ratio=0.5,
                              step_seed=step, scorer=None)
        seen += [g.qid for g in groups]
    assert 3 not in seen and len(set(seen)) == 15
