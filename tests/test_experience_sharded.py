"""Experience pool sharded over 2 real gloo ranks vs the same inputs in one process (DP=1)."""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from exgrpo_megatron.config.schema import ExperienceConfig
from exgrpo_megatron.experience import (
    CandidateScores,
    GroupOutcome,
    ShardedExperiencePool,
    mean_token_entropy,
    owner_rank,
)
from tests.helpers.multirank import run_on_ranks

K, DP, STEPS = 8, 2, 6


def step_groups(step: int, rank: int) -> list[GroupOutcome]:
    """The groups DP rank `rank` processed at `step`: random k, duplicates, retirements, overlaps."""
    rng = np.random.default_rng([step, rank])
    groups = []
    for qid in rng.choice(40, 12, replace=False):  # both ranks may see the same question in a step
        k = int(rng.choice([0, 1, 3, 4, 5, 7, 8], p=[.1, .15, .2, .2, .2, .1, .05]))
        ids = [rng.integers(0, 6, rng.integers(1, 5)).astype(np.int32) for _ in range(min(k, 4))]
        lps = [rng.uniform(-4, 0, len(t)).astype(np.float32) for t in ids]
        groups.append(GroupOutcome(int(qid), k, K, ids, lps, step))
    return groups


def scorer(qids, candidates):
    """Current-policy stand-in: token entropy = 0.1 * (token id + 1), mean over each candidate."""
    out = []
    for cands in candidates:
        width = max(t.length for t in cands)
        ent, mask = np.zeros((len(cands), width)), np.zeros((len(cands), width))
        for j, t in enumerate(cands):
            ent[j, : t.length] = 0.1 * (t.token_ids + 1)
            mask[j, : t.length] = 1
        out.append(CandidateScores(mean_entropy=mean_token_entropy(ent, mask).numpy()))
    return out


def contents(pool: ShardedExperiencePool) -> dict:
    shard = pool.shard
    return {q: (shard.bucket_of(q), [(t.token_ids.tolist(), t.logprobs.tolist(), t.step) for t in shard.candidates(q)])
            for q in shard.question_ids()}


def choices(result) -> list:
    return [(c.qid, c.bucket, c.trajectory.token_ids.tolist(), c.trajectory.logprobs.tolist()) for c in result]


def sharded_run() -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp_group = dist.new_group(ranks=list(range(DP)), backend="gloo")
    pool = ShardedExperiencePool(K, ExperienceConfig(max_trajectories_per_question=3), dp_group=dp_group)
    newly_retired = []
    for step in range(STEPS):
        newly_retired.append(pool.update(step_groups(step, rank)))
    samples = [choices(pool.sample(n, rng_seed=seed, scorer=scorer)) for n, seed in [(5, 1), (64, 2), (9, 3)]]
    state = pool.state_dict()
    all_states: list = [None] * DP
    dist.all_gather_object(all_states, state, group=dp_group)
    same = ShardedExperiencePool(K, ExperienceConfig(max_trajectories_per_question=3), dp_group=dp_group)
    same.load_state_dict(state)
    union_reload = ShardedExperiencePool(K, ExperienceConfig(max_trajectories_per_question=3), dp_group=dp_group)
    union_reload.load_state_dicts(all_states)
    single = ShardedExperiencePool(K, ExperienceConfig(max_trajectories_per_question=3))  # DP=1: all ranks' groups
    for step in range(STEPS):
        single.update([g for r in range(DP) for g in step_groups(step, r)])
    from_single = ShardedExperiencePool(K, ExperienceConfig(max_trajectories_per_question=3), dp_group=dp_group)
    from_single.load_state_dicts([single.state_dict()])  # reshard 1 -> 2

    # uniformity of the cross-rank split: one bucket of 30 questions, 20 on rank 0 and 10 on rank 1
    owned = {r: [q for q in range(1000, 2000) if owner_rank(q, DP) == r] for r in range(DP)}
    uneven = ShardedExperiencePool(K, ExperienceConfig(metric="random"), dp_group=dp_group)
    qids = owned[0][:20] + owned[1][:10]
    mine = [q for q in qids if owner_rank(q, DP) == rank]
    uneven.update([GroupOutcome(q, 4, K, [np.array([q], np.int32)], [np.zeros(1, np.float32)]) for q in mine])
    inclusion = {q: 0 for q in qids}
    for seed in range(300):
        for c in uneven.sample(10, rng_seed=seed):
            inclusion[c.qid] += 1
    return dict(rank=rank, contents=contents(pool), retired=sorted(pool.retired_ids()), stats=pool.stats(),
                newly_retired=newly_retired, samples=samples, state=state, same=contents(same),
                union_reload=contents(union_reload), from_single=contents(from_single), inclusion=inclusion)


def test_dp2_pool_equals_dp1_pool_and_sampling_is_global():
    results = run_on_ranks(sharded_run, world_size=DP)
    reference = ShardedExperiencePool(K, ExperienceConfig(max_trajectories_per_question=3))
    ref_retired = []
    for step in range(STEPS):
        ref_retired.append(reference.update([g for r in range(DP) for g in step_groups(step, r)]))
    ref_contents = contents(reference)
    assert len(ref_contents) > 10 and len(reference.retired_ids()) > 3  # the scenario exercises both paths

    # every group lands on exactly one owner; the union of the shards is the DP=1 pool
    union: dict = {}
    for res in results:
        assert all(owner_rank(q, DP) == res["rank"] for q in res["contents"])
        assert not set(union) & set(res["contents"])
        union.update(res["contents"])
    assert union == ref_contents
    assert all(len(res["contents"]) > 0 for res in results)

    # retired set, newly-retired lists and stats agree on all ranks and with DP=1
    for res in results:
        assert res["retired"] == sorted(reference.retired_ids())
        assert res["newly_retired"] == ref_retired
        assert res["stats"] == reference.stats()

    # sample(): identical on both ranks, distinct, min(n, pool) long, lowest-mean-entropy candidate
    assert results[0]["samples"] == results[1]["samples"]
    for (n, _), drawn in zip([(5, 1), (64, 2), (9, 3)], results[0]["samples"], strict=True):
        assert len(drawn) == min(n, len(ref_contents))
        assert [d[0] for d in drawn] == sorted({d[0] for d in drawn})
        for qid, bucket, ids, lps in drawn:
            k, stored = ref_contents[qid]
            assert bucket == k
            means = [np.mean(0.1 * (np.asarray(t, dtype=np.float64) + 1)) for t, _, _ in stored]
            assert (ids, lps) == (stored[int(np.argmin(means))][0], stored[int(np.argmin(means))][1])

    # state round trip at DP=2, reload of all shards at DP=2, and reshard 2 -> 1 lose nothing
    for res in results:
        assert res["same"] == res["contents"] and res["union_reload"] == res["contents"]
        assert res["from_single"] == res["contents"]
    single = ShardedExperiencePool(K, ExperienceConfig(max_trajectories_per_question=3))
    single.load_state_dicts([res["state"] for res in results])
    assert contents(single) == ref_contents and single.retired_ids() == reference.retired_ids()
    assert single.stats() == reference.stats()

    # the cross-rank split is uniform over the global bucket: P(include) = 10/30 for every question,
    # although rank 0 holds twice as many of them as rank 1
    assert results[0]["inclusion"] == results[1]["inclusion"]
    counts = np.array(list(results[0]["inclusion"].values()), dtype=np.float64)
    expected = 300 * 10 / 30
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert counts.sum() == 3000 and chi2 < 58.30  # chi2_{0.999}(29)
