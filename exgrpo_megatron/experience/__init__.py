"""ExGRPO experience pool: storage, correctness buckets, sampling, trajectory selection, DP sharding.

Pure numpy/torch (+ torch.distributed for the sharded pool); imports no megatron model code.
Typical use by the trainer (every rank, same order):

    from megatron.core import parallel_state as ps
    pool = ShardedExperiencePool(K, cfg.experience, dp_group=ps.get_data_parallel_group_gloo())  # None: one process
    schedule = ExperienceSchedule(cfg.experience.delayed_start_pass_rate)   # warm-up -> collecting -> mixed
    replayed = pool.sample(int(rho * B), rng_seed=seed * 1_000_003 + step, scorer=policy_scorer) \
        if schedule.phase is Phase.MIXED else []                   # identical list on every rank, sorted by qid
    ... fresh prompts skip pool.retired_ids() ...
    # collection once the schedule collects ([C] §1.2; until then k only, no trajectories), retirement from step 1:
    pool.update(my_groups)
    pool.expire(step)                                 # the age bound (experience.max_age_steps)
    schedule.end_step(solved_fraction(rewards_of_the_step, dp_group), step)
    logger.log(pool.stats())
"""

from exgrpo_megatron.experience.buckets import BUCKET_MODES, IndexedBuckets, bucket_probabilities, draw_bucket_counts
from exgrpo_megatron.experience.routing import owner_rank, splitmix64
from exgrpo_megatron.experience.schedule import ExperienceSchedule, Phase, legacy_state, solved_fraction
from exgrpo_megatron.experience.selection import (
    SELECTION_METRICS,
    Scorer,
    choose_trajectories,
    mean_token_entropy,
    mean_token_nll,
    select_trajectory_index,
)
from exgrpo_megatron.experience.shard import ExperienceShard, classify_group
from exgrpo_megatron.experience.sharded import ShardedExperiencePool
from exgrpo_megatron.experience.types import CandidateScores, GroupOutcome, ReplayChoice, Trajectory, as_trajectory

__all__ = [
    "BUCKET_MODES", "SELECTION_METRICS", "CandidateScores", "ExperienceShard", "GroupOutcome", "IndexedBuckets",
    "ExperienceSchedule", "Phase", "ReplayChoice", "Scorer", "ShardedExperiencePool", "Trajectory", "as_trajectory",
    "bucket_probabilities", "choose_trajectories", "classify_group", "draw_bucket_counts", "mean_token_entropy",
    "mean_token_nll", "legacy_state", "owner_rank", "select_trajectory_index",
    "solved_fraction", "splitmix64",
]
