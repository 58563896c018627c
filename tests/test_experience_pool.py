"""Experience pool, single process: bucket probabilities, draws, update rules, selection, switch, state.

References are float64 formulas written here, independent of the implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from exgrpo_megatron.config.schema import ExperienceConfig
from exgrpo_megatron.experience import (
    CandidateScores,
    ExperienceSchedule,
    ExperienceShard,
    GroupOutcome,
    IndexedBuckets,
    Phase,
    ShardedExperiencePool,
    bucket_probabilities,
    draw_bucket_counts,
    legacy_state,
    mean_token_entropy,
    mean_token_nll,
    owner_rank,
    select_trajectory_index,
    splitmix64,
)

K = 8


def reference_probabilities(sizes, group_size, mode, mu=0.5, sigma=1.0):
    weights = []
    for k, size in enumerate(sizes):
        if size == 0:
            weights.append(0.0)
        elif mode == "normal":
            weights.append(math.exp(-((k - mu * group_size) ** 2) / (2 * sigma * sigma)))
        elif mode == "uniform":
            weights.append(1.0)
        elif mode == "linear":
            weights.append(k / group_size)
        else:
            weights.append(math.sqrt(k / group_size))
    total = sum(weights)
    return [w / total for w in weights]


def group(qid, k, correct_ids, step=0, group_size=K, logprob=-0.5):
    ids = [np.asarray(t, dtype=np.int32) for t in correct_ids]
    lps = [np.full(len(t), logprob, dtype=np.float32) for t in correct_ids]
    return GroupOutcome(qid, k, group_size, ids, lps, step)


def fill(pool, bucket_members: dict[int, range], length=4):
    groups = [group(q, k, [[q, k] + [1] * (length - 2)]) for k, qs in bucket_members.items() for q in qs]
    pool.update(groups)


# ---------------------------------------------------------------- bucket probabilities
@pytest.mark.parametrize("mode", ["normal", "uniform", "linear", "sqrt"])
def test_bucket_probabilities_match_reference(mode):
    rng = np.random.default_rng(0)
    for _ in range(20):
        sizes = rng.integers(0, 3, size=K + 1) * rng.integers(1, 50, size=K + 1)
        sizes[rng.integers(1, K + 1)] = 5  # at least one non-empty bucket with positive weight
        mu, sigma = rng.uniform(0.1, 0.9), rng.uniform(0.3, 2.0)
        got = bucket_probabilities(sizes, K, mode, mu, sigma)
        np.testing.assert_allclose(got, reference_probabilities(sizes, K, mode, mu, sigma), rtol=1e-12, atol=0)
        assert np.all(got[sizes == 0] == 0.0)


def test_bucket_probabilities_paper_values_k8():
    sizes = np.array([0, 3, 3, 3, 3, 3, 3, 3, 0])
    p = bucket_probabilities(sizes, K)
    expected = {1: .0044, 2: .054, 3: .242, 4: .399, 5: .242, 6: .054, 7: .0044}
    for k, v in expected.items():
        assert abs(p[k] - v) < 5e-4, (k, p[k], v)
    assert p[0] == 0 and p[8] == 0 and abs(p.sum() - 1) < 1e-12


# ---------------------------------------------------------------- draws
def test_chi_square_bucket_frequencies_follow_p():
    pool = ShardedExperiencePool(K, ExperienceConfig(metric="random"))
    fill(pool, {k: range(1000 * k, 1000 * k + 200) for k in range(1, 8)})
    observed = np.zeros(K + 1)
    for seed in range(160):  # 160 x 64 = 10240 draws
        for choice in pool.sample(64, rng_seed=seed):
            observed[choice.bucket] += 1
    n = observed.sum()
    assert n == 160 * 64

    def chi2(probs):
        return sum((observed[k] - n * probs[k]) ** 2 / (n * probs[k]) for k in range(1, 8))

    # 7 non-empty buckets -> 6 degrees of freedom; chi2_{0.999}(6) = 22.458
    assert chi2(reference_probabilities(pool.shard.bucket_sizes, K, "normal")) < 22.458
    assert chi2(reference_probabilities(pool.shard.bucket_sizes, K, "uniform")) > 1000  # the test has power


def test_excess_over_a_small_bucket_is_reassigned_in_proportion_to_p():
    sizes = np.array([0, 0, 0, 50, 2, 50, 0, 0, 0])
    p = bucket_probabilities(sizes, K)
    rng = np.random.default_rng(1)
    third = []
    for _ in range(400):
        counts = draw_bucket_counts(rng, p, sizes, 40)
        assert counts.sum() == 40 and np.all(counts <= sizes) and counts[4] == 2
        third.append(counts[3])
    assert abs(np.mean(third) - 19.0) < 0.6  # p3 == p5: the 38 others split evenly on average
    only_room = np.array([0, 0, 0, 0, 3, 10, 0, 0, 0])
    counts = draw_bucket_counts(rng, bucket_probabilities(only_room, K), only_room, 13)
    assert counts.tolist() == only_room.tolist()


def test_sample_is_without_replacement_and_capped_by_pool_size():
    pool = ShardedExperiencePool(K, ExperienceConfig(metric="random"))
    fill(pool, {3: range(0, 7), 4: range(100, 103), 6: range(200, 205)})
    everything = pool.sample(64, rng_seed=3)
    assert len(everything) == 15
    assert sorted(c.qid for c in everything) == sorted([*range(7), *range(100, 103), *range(200, 205)])
    for seed in range(30):
        drawn = [c.qid for c in pool.sample(9, rng_seed=seed)]
        assert len(drawn) == 9 and len(set(drawn)) == 9 and drawn == sorted(drawn)
    assert pool.sample(5, rng_seed=7) == pool.sample(5, rng_seed=7)


def test_indexed_buckets_match_a_set_model_under_random_operations():
    rng = np.random.default_rng(2)
    buckets, model = IndexedBuckets(K + 1, initial_capacity=2), {}
    for _ in range(3000):
        qid = int(rng.integers(0, 300))
        if qid in model and rng.random() < 0.3:
            buckets.remove(qid)
            del model[qid]
        else:
            k = int(rng.integers(0, K + 1))
            buckets.place(qid, k)
            model[qid] = k
    for k in range(K + 1):
        assert sorted(buckets.members(k).tolist()) == sorted(q for q, b in model.items() if b == k)
        assert buckets.sizes[k] == sum(1 for b in model.values() if b == k)
    k_big = int(np.argmax(buckets.sizes))
    drawn = buckets.draw(k_big, int(buckets.sizes[k_big]), rng)
    assert sorted(drawn) == sorted(buckets.members(k_big).tolist())


# ---------------------------------------------------------------- update rules
def test_eligibility_window_and_stale_bucket():
    shard = ExperienceShard(K, ExperienceConfig(admit_correct_above=2, admit_correct_at_most=5))
    assert shard.update_group(1, 2, K, []) == "ignore"
    shard.update_group(1, 3, K, group(1, 3, [[1, 2, 3]]).trajectories())
    assert shard.bucket_of(1) == 3 and len(shard.candidates(1)) == 1
    assert shard.update_group(2, 6, K, group(2, 6, [[9, 9]]).trajectories()) == "ignore"  # above the admission
    assert 2 not in shard
    assert shard.update_group(1, 0, K, []) == "ignore"
    assert shard.bucket_of(1) == 3 and len(shard.candidates(1)) == 1  # stale bucket kept
    assert shard.update_group(1, 6, K, group(1, 6, [[9, 9]]).trajectories()) == "store"  # in the pool: up to K-1
    assert shard.bucket_of(1) == 6 and len(shard.candidates(1)) == 2
    default = ExperienceShard(K)
    assert (default.admit_above, default.admit_at_most, default.retire_above) == (0, K - 1, K - 1)
    default.update_group(2, 7, K, group(2, 7, [[5]]).trajectories())
    assert default.bucket_of(2) == 7


def test_retirement_removes_and_blocks_readding():
    pool = ShardedExperiencePool(K, ExperienceConfig(metric="random"))
    pool.update([group(5, 3, [[1, 2], [3, 4]]), group(6, 2, [[7]])])
    assert pool.stats()["experience/trajectories"] == 3
    assert pool.update([group(5, K, [[1, 2]] * K)]) == [5]
    assert 5 not in pool.shard and 5 in pool.retired_ids() and pool.retired_ids() == frozenset({5})
    pool.update([group(5, 4, [[8, 8]])])
    assert 5 not in pool.shard
    stats = pool.stats()
    assert stats["experience/retired"] == 1 and stats["experience/questions"] == 1
    assert stats["experience/trajectories"] == 1 and stats["experience/stored_tokens"] == 1
    assert stats["experience/bucket_3"] == 0 and stats["experience/bucket_2"] == 1
    assert all(c.qid == 6 for s in range(5) for c in pool.sample(4, rng_seed=s))


def test_duplicates_skipped_and_cap_evicts_oldest():
    pool = ShardedExperiencePool(K, ExperienceConfig(metric="random"))
    pool.update([group(1, 2, [[1, 2, 3], [1, 2, 3]], step=0)])
    pool.update([group(1, 3, [[1, 2, 3], [1, 2]], step=1, logprob=-9.0)])
    stored = pool.shard.candidates(1)
    assert [t.token_ids.tolist() for t in stored] == [[1, 2, 3], [1, 2]]
    assert stored[0].logprobs.tolist() == [-0.5] * 3 and stored[0].step == 0  # first copy kept
    assert stored[0].token_ids.dtype == np.int32 and stored[0].logprobs.dtype == np.float32
    capped = ShardedExperiencePool(K, ExperienceConfig(max_trajectories_per_question=2, metric="random"))
    for step in range(4):
        capped.update([group(1, 2, [[step, step]], step=step)])
    assert [t.step for t in capped.shard.candidates(1)] == [2, 3]
    assert capped.stats()["experience/stored_tokens"] == 4


def test_schedule_phases():
    """warm-up until a step's solved fraction exceeds the start ratio, then one collecting step (the pool is still
    empty), then mixed for good; <= 0 starts collecting at step 1; without a pool it never leaves warm-up."""
    W, C, M = Phase.WARMUP, Phase.COLLECTING, Phase.MIXED
    schedule = ExperienceSchedule(0.35)
    assert schedule.phase is W and not schedule.collects
    assert [schedule.end_step(f, s) for s, f in enumerate((0.1, 0.35, 0.36, 0.0, 0.9), start=1)] == [W, W, C, M, M]
    assert schedule.switched_at_step == 3 and schedule.collects
    restored = ExperienceSchedule(0.35)
    restored.load_state_dict(schedule.state_dict())
    assert restored.phase is M and restored.switched_at_step == 3
    assert ExperienceSchedule(0.0).phase is C and ExperienceSchedule(-1).end_step(0.0, 1) is M
    off = ExperienceSchedule(0.0, enabled=False)
    assert off.phase is W and off.end_step(1.0, 1) is W


@pytest.mark.parametrize("is_on,collected_once,phase", [(False, False, Phase.WARMUP), (True, False, Phase.COLLECTING),
                                                        (True, True, Phase.MIXED)])
def test_schedule_resumes_pre_schedule_checkpoints(is_on, collected_once, phase):
    """A trainer state written before the schedule (a delayed-start switch + collected_once) maps to its phase."""
    schedule = ExperienceSchedule(0.35)
    switch = {"start_sratio": 0.35, "is_on": is_on, "switched_at_step": 4 if is_on else None}
    schedule.load_state_dict(legacy_state(switch, collected_once))
    assert schedule.phase is phase and schedule.switched_at_step == switch["switched_at_step"]


# ---------------------------------------------------------------- selection
def test_mean_entropy_and_nll_match_reference():
    rng = np.random.default_rng(4)
    ent, logp = rng.uniform(0, 3, (5, 11)), rng.uniform(-5, 0, (5, 11))
    mask = np.zeros((5, 11))
    for i, n in enumerate([1, 4, 7, 11, 3]):
        mask[i, :n] = 1
    ref_ent = [sum(ent[i, t] for t in range(11) if mask[i, t]) / mask[i].sum() for i in range(5)]
    ref_nll = [-sum(logp[i, t] for t in range(11) if mask[i, t]) / mask[i].sum() for i in range(5)]
    got = mean_token_entropy(torch.tensor(ent, dtype=torch.float64), torch.tensor(mask))
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), ref_ent, rtol=1e-14)
    np.testing.assert_allclose(mean_token_nll(logp, mask).numpy(), ref_nll, rtol=1e-14)


TOKEN_ENTROPY = {1: 1.0, 2: 0.5, 3: 2.0}  # a fixed per-token "policy entropy" for the test scorer


def entropy_scorer(qids, candidates):
    out = []
    for cands in candidates:
        width = max(t.length for t in cands)
        ent, mask = np.zeros((len(cands), width)), np.zeros((len(cands), width))
        for j, t in enumerate(cands):
            ent[j, : t.length] = [TOKEN_ENTROPY[int(x)] for x in t.token_ids]
            mask[j, : t.length] = 1
        nll = 3.0 - mean_token_entropy(ent, mask).numpy()
        out.append(CandidateScores(mean_entropy=mean_token_entropy(ent, mask).numpy(), mean_nll=nll))
    return out


def test_selection_uses_mean_not_total_entropy():
    short_high = [1, 1]  # mean 1.0, total 2.0
    long_low = [2] * 10  # mean 0.5, total 5.0
    short_top = [3]  # mean 2.0, total 2.0
    pool = ShardedExperiencePool(K, ExperienceConfig(metric="ent"))
    pool.update([group(11, 3, [short_high, long_low, short_top])])
    (choice,) = pool.sample(1, rng_seed=0, scorer=entropy_scorer)
    assert choice.trajectory.token_ids.tolist() == long_low  # total entropy would pick short_high
    scores = CandidateScores(mean_entropy=np.array([1.0, 0.5, 2.0]), mean_nll=np.array([0.2, 0.9, 0.1]))
    assert select_trajectory_index(scores, "ent", 3) == 1
    assert select_trajectory_index(scores, "ppl", 3) == 2
    ppl_pool = ShardedExperiencePool(K, ExperienceConfig(metric="ppl"))
    ppl_pool.update([group(11, 3, [short_high, long_low, short_top])])
    assert ppl_pool.sample(1, 0, entropy_scorer)[0].trajectory.token_ids.tolist() == short_top
    rng = np.random.default_rng(0)
    assert {select_trajectory_index(None, "random", 3, rng) for _ in range(50)} == {0, 1, 2}


def test_scorer_sees_only_multi_candidate_questions_in_stored_order():
    seen = []

    def recording_scorer(qids, candidates):
        seen.append((list(qids), [[t.token_ids.tolist() for t in c] for c in candidates]))
        return entropy_scorer(qids, candidates)

    pool = ShardedExperiencePool(K)
    pool.update([group(1, 2, [[1], [2, 2]]), group(2, 2, [[3]])])
    pool.sample(2, rng_seed=0, scorer=recording_scorer)
    assert seen == [([1], [[[1], [2, 2]]])]


# ---------------------------------------------------------------- ownership and state
def test_splitmix64_known_vector_and_owner_balance():
    golden = 0x9E3779B97F4A7C15
    # published SplitMix64 stream for seed 0: e220a8397b1dcdaf, 6e789e6aa1b965f4, 06c45d188009454f
    assert [splitmix64(i * golden % 2**64) for i in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    owners = np.bincount([owner_rank(q, 4) for q in range(20000)], minlength=4)
    assert owners.min() > 4700 and owner_rank(123, 1) == 0


def _contents(pool):
    shard = pool.shard
    return {q: (shard.bucket_of(q), [(t.token_ids.tolist(), t.logprobs.tolist(), t.step) for t in shard.candidates(q)])
            for q in shard.question_ids()}


def test_state_round_trip_is_exact_and_pickle_free():
    pool = ShardedExperiencePool(K, ExperienceConfig(metric="random", max_trajectories_per_question=3))
    rng = np.random.default_rng(5)
    for step in range(6):
        groups = []
        for q in rng.choice(60, 20, replace=False):
            k = int(rng.integers(0, K + 1))
            groups.append(group(int(q), k, [rng.integers(0, 50, rng.integers(1, 6)) for _ in range(min(k, 3))],
                                step=step, logprob=float(rng.uniform(-3, 0))))
        pool.update(groups)
    state = pool.state_dict()
    for name, arr in state["arrays"].items():
        assert isinstance(arr, np.ndarray) and arr.dtype != object, name
    assert state["arrays"]["token_ids"].dtype == np.int32 and state["arrays"]["logprobs"].dtype == np.float32
    restored = ShardedExperiencePool(K, ExperienceConfig(metric="random", max_trajectories_per_question=3))
    restored.load_state_dict(state)
    assert _contents(restored) == _contents(pool)
    assert restored.retired_ids() == pool.retired_ids() and restored.stats() == pool.stats()
    assert [(c.qid, c.trajectory.step) for c in restored.sample(10, 9)] == [
        (c.qid, c.trajectory.step) for c in pool.sample(10, 9)]
