"""The ExGRPO experience pool, sharded across data-parallel ranks.

Question q lives on DP rank owner_rank(q, dp_size) (routing.py). Every method is a collective over
the DP group when dp_size > 1: all DP ranks call it in the same order with the arguments described.

Global semantics of `sample(n, seed)` (docs/exgrpo.md, with the pool split over ranks):
  1. all-gather the per-rank bucket sizes; global size S_k = sum over ranks;
  2. n_exp = min(n, sum_k S_k); p = bucket_probabilities(S); counts ~ Multinomial(n_exp, p) with
     re-assignment of the excess over full buckets -- computed identically on every rank from `seed`;
  3. bucket k's count is split across ranks by a multivariate hypergeometric draw over the ranks'
     shard sizes (same shared rng), which is the rank histogram of a uniform draw without replacement
     from the global bucket; each rank then draws its share uniformly without replacement from its
     shard (a rank-specific rng), so the union is uniform without replacement over the global bucket;
  4. each rank picks a trajectory per drawn question with its scorer (a forward on its own replica), keeping
     the scorer's current-policy log-probs of the chosen one (they travel with the choice). Every rank calls the
     scorer whenever questions are drawn (n_exp > 0, the same on every rank) and the metric needs scores, with
     its own multi-candidate questions or none: under expert parallelism the scorer's forward is a collective
     of the ranks (distributed/lockstep.py);
  5. the choices are all-gathered and sorted by qid: every rank returns the same list.

TP/PP ranks of one replica: megatron's DP group connects the ranks with the same (tp, pp)
coordinate, so each (tp, pp) coordinate runs its own copy of this protocol. All ranks of a replica
pass identical `groups` (the replica's rollouts and rewards) and identical seeds, and every update is
a deterministic function of them, so the pool state -- and therefore every draw and every scorer call
-- is identical across the TP x PP ranks of a replica (each holds a full copy of its replica's shard).
The caller passes `parallel_state.get_data_parallel_group_gloo()` (objects travel over gloo, CPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist

from exgrpo_megatron.config.schema import ExperienceConfig
from exgrpo_megatron.experience.buckets import bucket_probabilities, draw_bucket_counts
from exgrpo_megatron.experience.routing import all_gather_choices, all_gather_int64, owner_rank, route_groups
from exgrpo_megatron.experience.selection import SELECT_MODES, SELECTION_METRICS, Scorer, choose_trajectories
from exgrpo_megatron.experience.shard import RETIRE, ExperienceShard
from exgrpo_megatron.experience.types import GroupOutcome, ReplayChoice, Trajectory


class ShardedExperiencePool:
    """Experience pool over a DP group (dp_group=None: a single process owns everything), configured by one
    `ExperienceConfig` (conf/experience/)."""

    def __init__(self, group_size: int, settings: ExperienceConfig | None = None,
                 dp_group: dist.ProcessGroup | None = None) -> None:
        """`settings`: the experience config group (None: its defaults with admission up to K - 1)."""
        x = settings or ExperienceConfig(admit_correct_at_most=group_size - 1)
        if x.metric not in SELECTION_METRICS:
            raise ValueError(f"unknown selection metric {x.metric!r}; expected one of {SELECTION_METRICS}")
        if x.select_mode not in SELECT_MODES:
            raise ValueError(f"unknown selection mode {x.select_mode!r}; expected one of {SELECT_MODES}")
        bucket_probabilities(np.ones(group_size + 1), group_size, x.bucket_manager, x.bucket_mu, x.bucket_sigma)
        self.settings = x
        self.group_size = group_size
        self.bucket_mode, self.bucket_mu, self.bucket_sigma = x.bucket_manager, x.bucket_mu, x.bucket_sigma
        self.metric, self.select_mode = x.metric, x.select_mode
        self.dp_group = dp_group
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.shard = ExperienceShard(group_size, x)
        self._retired_view: frozenset[int] | None = None

    def owns(self, qid: int) -> bool:
        return owner_rank(qid, self.dp_size) == self.dp_rank

    # ---------------------------------------------------------------- update
    def update(self, groups: list[GroupOutcome]) -> list[int]:
        """Apply the step's group outcomes; each DP rank passes the groups IT processed.

        Groups are applied in (source rank, local order) on every rank; trajectories are stored only
        by the owner, retirements everywhere. Returns the questions newly retired by this call, the
        same list on every rank.
        """
        newly_retired: list[int] = []
        for qid, k, size, _step, trajs in route_groups(groups, self.dp_group, self.dp_rank, self.dp_size):
            was_retired = qid in self.shard.retired
            if self.shard.update_group(qid, k, size, trajs) == RETIRE and not was_retired:
                newly_retired.append(qid)
        if newly_retired:
            self._retired_view = None
        return newly_retired

    def expire(self, step: int) -> int:
        """The age bound after step `step`'s update (`ExperienceShard.expire`): each rank drops its own expired
        trajectories; returns how many this rank dropped. Not a collective."""
        return self.shard.expire(step)

    # ---------------------------------------------------------------- sample
    def sample(self, n_total: int, rng_seed: int, scorer: Scorer | None = None) -> list[ReplayChoice]:
        """Draw min(n_total, #questions in the pool) questions (protocol in the module docstring) and
        choose one stored trajectory each; identical result on every rank, sorted by qid.

        rng_seed (>= 0) must be the same on all ranks (e.g. hash of (seed, step)). The scorer is
        called exactly once on every rank when n_exp > 0 and the metric needs scores, with this rank's drawn
        questions that hold >= 2 candidates (possibly none).
        """
        if rng_seed < 0:
            raise ValueError("rng_seed must be >= 0")
        sizes_per_rank = all_gather_int64(self.shard.bucket_sizes, self.dp_group, self.dp_size)
        global_sizes = sizes_per_rank.sum(axis=0)
        n_exp = min(int(n_total), int(global_sizes.sum()))
        local: list[tuple[int, int, Trajectory, np.ndarray | None]] = []
        if n_exp > 0:
            shared_rng = np.random.default_rng([rng_seed, 0])
            probs = bucket_probabilities(global_sizes, self.group_size, self.bucket_mode, self.bucket_mu,
                                         self.bucket_sigma)
            counts = draw_bucket_counts(shared_rng, probs, global_sizes, n_exp)
            my_counts = np.zeros_like(counts)
            for k in np.flatnonzero(counts):
                split = shared_rng.multivariate_hypergeometric(sizes_per_rank[:, k], int(counts[k]))
                my_counts[k] = split[self.dp_rank]
            local_rng = np.random.default_rng([rng_seed, 1, self.dp_rank])
            drawn = self.shard.draw(my_counts, local_rng)
            qids = [q for q, _ in drawn]
            chosen = choose_trajectories(qids, [self.shard.candidates(q) for q in qids], self.metric, scorer,
                                         local_rng, self.select_mode)
            local = [(q, k, t, lp) for (q, k), (t, lp) in zip(drawn, chosen, strict=True)]
        everything = all_gather_choices(local, self.dp_group, self.dp_size) if n_exp > 0 else []
        return [ReplayChoice(q, t, k, lp) for q, k, t, lp in sorted(everything, key=lambda c: c[0])]

    # ---------------------------------------------------------------- queries
    def retired_ids(self) -> frozenset[int]:
        """The global retired set (identical on every rank); cached until the next retirement."""
        if self._retired_view is None:
            self._retired_view = frozenset(self.shard.retired)
        return self._retired_view

    def stats(self) -> dict[str, float]:
        """Pool-wide counts (all-reduced): questions per bucket, questions, trajectories, stored tokens,
        retired questions."""
        shard = self.shard
        local = np.concatenate([shard.bucket_sizes, [shard.num_questions, shard.num_trajectories, shard.num_tokens]])
        total = all_gather_int64(local, self.dp_group, self.dp_size).sum(axis=0)
        k1 = self.group_size + 1
        out = {f"experience/bucket_{k}": float(total[k]) for k in range(k1)}
        out["experience/questions"] = float(total[k1])
        out["experience/trajectories"] = float(total[k1 + 1])
        out["experience/stored_tokens"] = float(total[k1 + 2])
        out["experience/retired"] = float(len(shard.retired))
        return out

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: {"arrays": {name: np.ndarray}, "meta": json-able} (see ExperienceShard);
        meta also records dp_rank / dp_size. Not a collective."""
        state = self.shard.state_dict()
        state["meta"].update(dp_rank=self.dp_rank, dp_size=self.dp_size)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from this rank's own saved shard (same DP size)."""
        saved = int(state["meta"].get("dp_size", 1))
        if saved != self.dp_size:
            raise ValueError(f"shard saved at dp_size={saved}; use load_state_dicts(all shards) to reshard")
        self.load_state_dicts([state])

    def load_state_dicts(self, states: list[dict[str, Any]]) -> None:
        """Reshard: given the shards saved at ANY DP size (all of them, in saved-rank order), keep the
        questions this rank owns under the current DP size; the retired set is the union."""
        self.shard.load_state_dicts(states, keep=self.owns if self.dp_size > 1 else None)
        self._retired_view = None
