"""One shard of the experience pool: stored correct trajectories, correctness buckets, retired set.

Update rule for a group of question q with k correct out of K (docs/exgrpo.md; the thresholds are
`ExperienceConfig`'s: above = admit_correct_above, at_most = admit_correct_at_most, retire = retire_correct_above,
K - 1 when unset):
  * q already retired: ignored (a retired question is never stored or drawn again);
  * k > retire: retire q -- its trajectories are dropped and q joins the retired set (the paper: k == K; the
    authors' Megatron port: k > K/2);
  * q not in the pool and above < k <= at_most, or q in the pool and above < k <= retire: q moves to bucket k and
    its correct trajectories are appended (exact token-id duplicates skipped; with a cap, the oldest are evicted);
  * otherwise (k <= above, e.g. all-wrong groups, or at_most < k for a question not in the pool): nothing
    changes. This keeps the original semantics, where an all-zero group leaves q in its stale bucket.
Age bound (`expire(step)`, max_age_steps = A > 0): after step t's update, trajectories collected at a step s with
s + A < t + 1 are dropped, so a replayed trajectory is at most A steps old; a question left with none leaves its
bucket (not retired: it may enter again). The order of removals is by qid, a function of the saved state, so a
resumed pool evicts exactly as the uninterrupted one.
A question is in a bucket iff it holds >= 1 trajectory (an eligible group with no stored trajectory adds nothing).
Every operation is O(group) / O(draw) / O(evicted), never O(pool).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from exgrpo_megatron.config.schema import ExperienceConfig
from exgrpo_megatron.experience.buckets import IndexedBuckets
from exgrpo_megatron.experience.types import Trajectory

STATE_FORMAT = "exgrpo_experience_shard"
STATE_VERSION = 1

RETIRE, STORE, IGNORE = "retire", "store", "ignore"


def classify_group(k_correct: int, in_pool: bool, admit_above: int, admit_at_most: int, retire_above: int) -> str:
    """retire (k > retire_above), store (above < k <= at_most entering, above < k <= retire_above in the pool) or
    ignore."""
    if k_correct > retire_above:
        return RETIRE
    if admit_above < k_correct <= (retire_above if in_pool else admit_at_most):
        return STORE
    return IGNORE


class ExperienceShard:
    """The part of the pool one DP rank owns (or the whole pool in a single process)."""

    def __init__(self, group_size: int, settings: ExperienceConfig | None = None) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        x = settings or ExperienceConfig(admit_correct_at_most=group_size - 1)
        self.group_size = group_size
        self.admit_above, self.admit_at_most = x.admit_correct_above, x.admit_correct_at_most
        self.retire_above = x.retire_above(group_size)
        if x.max_trajectories_per_question < 0 or x.max_age_steps < 0:
            raise ValueError("max_trajectories_per_question and max_age_steps must be >= 0 (0 = no bound)")
        self.max_trajectories_per_question = x.max_trajectories_per_question
        self.max_age_steps = x.max_age_steps
        self._reset()

    def _reset(self) -> None:
        self._trajectories: dict[int, list[Trajectory]] = {}
        self._buckets = IndexedBuckets(self.group_size + 1)
        self._retired: set[int] = set()
        self.num_trajectories = 0
        self.num_tokens = 0
        self._expiry: list[tuple[int, int]] = []  # min-heap of (collection step, qid) of stored trajectories

    # ---------------------------------------------------------------- queries
    @property
    def bucket_sizes(self) -> np.ndarray:
        return self._buckets.sizes

    @property
    def num_questions(self) -> int:
        return len(self._buckets)

    @property
    def retired(self) -> set[int]:
        return self._retired

    def __contains__(self, qid: int) -> bool:
        return qid in self._buckets

    def bucket_of(self, qid: int) -> int:
        return self._buckets.bucket_of(qid)

    def candidates(self, qid: int) -> list[Trajectory]:
        return list(self._trajectories[qid])

    def question_ids(self) -> list[int]:
        return [int(q) for k in range(self.group_size + 1) for q in self._buckets.members(k)]

    # ---------------------------------------------------------------- updates
    def update_group(self, qid: int, k_correct: int, group_size: int, trajectories: list[Trajectory]) -> str:
        """Apply one group's outcome (rule in the module docstring); returns retire/store/ignore."""
        if group_size != self.group_size:
            raise ValueError(f"question {qid}: group of {group_size}, pool built for K={self.group_size}")
        if not 0 <= k_correct <= group_size:
            raise ValueError(f"question {qid}: k_correct={k_correct} outside 0..{group_size}")
        if qid in self._retired:
            return IGNORE
        action = classify_group(k_correct, qid in self._buckets, self.admit_above, self.admit_at_most,
                                self.retire_above)
        if action == RETIRE:
            self.retire(qid)
        elif action == STORE:
            self._store(qid, k_correct, trajectories)
        return action

    def retire(self, qid: int) -> None:
        self._retired.add(qid)
        self._drop(qid)

    def _drop(self, qid: int) -> None:
        stored = self._trajectories.pop(qid, None)
        if stored is None:
            return
        self._buckets.remove(qid)
        self.num_trajectories -= len(stored)
        self.num_tokens -= sum(t.length for t in stored)

    def _store(self, qid: int, k: int, trajectories: Iterable[Trajectory]) -> None:
        stored = self._trajectories.get(qid, [])
        for traj in trajectories:
            if any(s.same_tokens(traj) for s in stored):
                continue
            stored.append(traj)
            self.num_trajectories += 1
            self.num_tokens += traj.length
        cap = self.max_trajectories_per_question
        if cap and len(stored) > cap:
            for oldest in stored[:-cap]:
                self.num_trajectories -= 1
                self.num_tokens -= oldest.length
            del stored[:-cap]
        if stored:
            self._trajectories[qid] = stored
            self._buckets.place(qid, k)
            self._note_expiry(qid, stored)

    def _note_expiry(self, qid: int, stored: list[Trajectory]) -> None:
        if self.max_age_steps:
            heapq.heappush(self._expiry, (min(t.step for t in stored), qid))

    def expire(self, step: int) -> int:
        """After step `step`'s update: drop every trajectory collected before step + 1 - max_age_steps (module
        docstring); returns how many. No-op without an age bound."""
        if not self.max_age_steps:
            return 0
        cutoff = step + 1 - self.max_age_steps  # keep trajectories collected at >= cutoff
        due: set[int] = set()
        while self._expiry and self._expiry[0][0] < cutoff:
            due.add(heapq.heappop(self._expiry)[1])
        dropped = 0
        for qid in sorted(due):
            stored = self._trajectories.get(qid)
            if stored is None:  # retired or already emptied since it was noted
                continue
            keep = [t for t in stored if t.step >= cutoff]
            for t in stored:
                if t.step < cutoff:
                    dropped += 1
                    self.num_trajectories -= 1
                    self.num_tokens -= t.length
            if keep:
                self._trajectories[qid] = keep
                self._note_expiry(qid, keep)
            else:
                del self._trajectories[qid]
                self._buckets.remove(qid)
        return dropped

    # ---------------------------------------------------------------- drawing
    def draw(self, counts: np.ndarray, rng: np.random.Generator) -> list[tuple[int, int]]:
        """(qid, bucket) pairs: counts[k] distinct questions of bucket k, uniformly without replacement."""
        drawn: list[tuple[int, int]] = []
        for k in np.flatnonzero(counts):
            drawn.extend((qid, int(k)) for qid in self._buckets.draw(int(k), int(counts[k]), rng))
        return drawn

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """{"arrays": {name: np.ndarray}, "meta": json-able dict}; no pickled objects.

        Questions are listed by bucket, then by slot inside the bucket (so a reload reproduces the
        bucket order and hence seeded draws). qids/buckets/traj_counts: int64 [Q]; traj_lengths,
        traj_steps: int64 [T] (question-major, oldest first); token_ids int32 / logprobs float32 [sum
        lengths] concatenated in the same order; retired_ids int64 [R] sorted.
        """
        qids = self.question_ids()
        trajs = [t for q in qids for t in self._trajectories[q]]
        arrays = {
            "qids": np.asarray(qids, dtype=np.int64),
            "buckets": np.asarray([self._buckets.bucket_of(q) for q in qids], dtype=np.int64),
            "traj_counts": np.asarray([len(self._trajectories[q]) for q in qids], dtype=np.int64),
            "traj_lengths": np.asarray([t.length for t in trajs], dtype=np.int64),
            "traj_steps": np.asarray([t.step for t in trajs], dtype=np.int64),
            "token_ids": np.concatenate([t.token_ids for t in trajs]) if trajs else np.zeros(0, np.int32),
            "logprobs": np.concatenate([t.logprobs for t in trajs]) if trajs else np.zeros(0, np.float32),
            "retired_ids": np.asarray(sorted(self._retired), dtype=np.int64),
        }
        meta = {
            "format": STATE_FORMAT, "version": STATE_VERSION, "group_size": int(self.group_size),
            # saved under the names the shard format has always used (informational: a load does not read them)
            "lbound": int(self.admit_above), "rbound": int(self.admit_at_most), "retire_above": int(self.retire_above),
            "max_trajectories_per_question": int(self.max_trajectories_per_question),
            "max_age_steps": int(self.max_age_steps),
        }
        return {"arrays": arrays, "meta": meta}

    def load_state_dicts(self, states: list[dict[str, Any]], keep: Callable[[int], bool] | None = None) -> None:
        """Replace this shard's content with the questions of `states` that `keep(qid)` accepts (all if
        None), in the saved order; the retired set becomes the union of all saved retired sets."""
        self._reset()
        for state in states:
            meta = state["meta"]
            if meta.get("format") != STATE_FORMAT or int(meta.get("version", -1)) > STATE_VERSION:
                raise ValueError(f"not a supported experience shard state: {meta}")
            if int(meta["group_size"]) != self.group_size:
                raise ValueError(f"state has K={meta['group_size']}, pool has K={self.group_size}")
            self._retired.update(int(q) for q in state["arrays"]["retired_ids"])
        for state in states:
            arrays = state["arrays"]
            lengths = np.asarray(arrays["traj_lengths"], dtype=np.int64)
            token_offsets = np.concatenate([[0], np.cumsum(lengths)])
            traj_offsets = np.concatenate([[0], np.cumsum(arrays["traj_counts"])])
            token_ids, logprobs, steps = arrays["token_ids"], arrays["logprobs"], arrays["traj_steps"]
            for i, (qid, k) in enumerate(zip(arrays["qids"].tolist(), arrays["buckets"].tolist(), strict=True)):
                if qid in self._retired or (keep is not None and not keep(qid)):
                    continue
                stored = []
                for j in range(int(traj_offsets[i]), int(traj_offsets[i + 1])):
                    lo, hi = int(token_offsets[j]), int(token_offsets[j + 1])
                    stored.append(Trajectory(np.array(token_ids[lo:hi], dtype=np.int32),
                                             np.array(logprobs[lo:hi], dtype=np.float32), int(steps[j])))
                if qid in self._trajectories:
                    raise ValueError(f"question {qid} appears in two saved shards")
                self._trajectories[qid] = stored
                self._buckets.place(qid, int(k))
                self._note_expiry(qid, stored)
                self.num_trajectories += len(stored)
                self.num_tokens += int(lengths[int(traj_offsets[i]):int(traj_offsets[i + 1])].sum())
