"""Correctness buckets: their sampling probabilities, the per-bucket draw counts, and an O(1) index.

A question sits in bucket k = the number of correct responses (0..K) of its LATEST eligible group.
"""

from __future__ import annotations

import numpy as np

BUCKET_MODES = ("normal", "uniform", "linear", "sqrt")


def bucket_probabilities(
    bucket_sizes: np.ndarray, group_size: int, mode: str = "normal", mu: float = 0.5, sigma: float = 1.0
) -> np.ndarray:
    """Probability of drawing from each bucket k = 0..K (index k), zero for empty buckets.

    Weights (docs/exgrpo.md; [C] `weighted_bucket_sampler._normal_mapping`):
      normal:  w_k = exp(-(k - mu*K)^2 / (2 sigma^2)), k in COUNT units (successes out of K);
      uniform: w_k = 1;  linear: w_k = k/K;  sqrt: w_k = sqrt(k/K).
    p_k = w_k / sum_{j non-empty} w_j for non-empty k, 0 otherwise. If every non-empty bucket has zero
    weight (e.g. linear with only bucket 0 filled) the non-empty buckets are drawn uniformly.

    Paper vs code: [P] Alg. 1 / §4.1 write N(Acc = k/K; 0.5, sigma=1) in ACCURACY units, which is
    nearly uniform over k (p between .137 and .147 for K=8) and would make the paper's own sigma
    ablation (Tab. 3: 0.5 "narrower", 1.5 "approaches uniform") meaningless. The released code uses
    count units (sigma_acc = sigma/K), which is what we implement: for K=8 with buckets 1..7 non-empty,
    p = {1: .0044, 2: .054, 3: .242, 4: .399, 5: .242, 6: .054, 7: .0044}.
    """
    sizes = np.asarray(bucket_sizes)
    if sizes.shape != (group_size + 1,):
        raise ValueError(f"bucket_sizes must have K+1 = {group_size + 1} entries, got shape {sizes.shape}")
    k = np.arange(group_size + 1, dtype=np.float64)
    if mode == "normal":
        if sigma <= 0:
            raise ValueError("sigma must be > 0")
        weights = np.exp(-((k - mu * group_size) ** 2) / (2.0 * sigma**2))
    elif mode == "uniform":
        weights = np.ones_like(k)
    elif mode == "linear":
        weights = k / group_size
    elif mode == "sqrt":
        weights = np.sqrt(k / group_size)
    else:
        raise ValueError(f"unknown bucket mode {mode!r}; expected one of {BUCKET_MODES}")
    non_empty = sizes > 0
    weights = np.where(non_empty, weights, 0.0)
    total = weights.sum()
    if total <= 0.0:
        weights = non_empty.astype(np.float64)
        total = weights.sum()
    if total <= 0.0:
        return np.zeros_like(k)
    probs: np.ndarray = weights / total
    return probs


def draw_bucket_counts(rng: np.random.Generator, probabilities: np.ndarray, bucket_sizes: np.ndarray,
                       n: int) -> np.ndarray:
    """How many questions to draw from each bucket (docs/exgrpo.md, [P] Alg. 2).

    counts ~ Multinomial(n, p); a bucket's count above its size is clipped and the excess is
    re-assigned one draw at a time to buckets with room, in proportion to p (uniformly over buckets
    with room if all of those have p = 0). Requires n <= sum(bucket_sizes).
    """
    sizes = np.asarray(bucket_sizes, dtype=np.int64)
    if n > int(sizes.sum()):
        raise ValueError(f"cannot draw {n} questions from {int(sizes.sum())}")
    if n <= 0:
        return np.zeros_like(sizes)
    counts = rng.multinomial(n, probabilities).astype(np.int64)
    excess = int(np.maximum(counts - sizes, 0).sum())
    counts = np.minimum(counts, sizes)
    while excess > 0:
        has_room = counts < sizes
        weights = np.where(has_room, probabilities, 0.0)
        if weights.sum() <= 0.0:
            weights = has_room.astype(np.float64)
        k = int(rng.choice(len(sizes), p=weights / weights.sum()))
        counts[k] += 1
        excess -= 1
    return counts


class IndexedBuckets:
    """Per-bucket arrays of question ids with swap-remove, plus a qid -> (bucket, slot) index.

    move/remove/contains are O(1); drawing c members of a bucket is O(c) (independent of pool size).
    The order of members inside a bucket is part of the state (it decides which id a seeded draw picks).
    """

    def __init__(self, num_buckets: int, initial_capacity: int = 64) -> None:
        self._members = [np.empty(initial_capacity, dtype=np.int64) for _ in range(num_buckets)]
        self._sizes = np.zeros(num_buckets, dtype=np.int64)
        self._slot: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, qid: int) -> bool:
        return qid in self._slot

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes.copy()

    def bucket_of(self, qid: int) -> int:
        return self._slot[qid][0]

    def members(self, k: int) -> np.ndarray:
        return self._members[k][: self._sizes[k]].copy()

    def place(self, qid: int, k: int) -> None:
        """Put qid in bucket k (moving it if it sits in another bucket)."""
        where = self._slot.get(qid)
        if where is not None:
            if where[0] == k:
                return
            self.remove(qid)
        n = int(self._sizes[k])
        if n == self._members[k].shape[0]:
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            grown[:n] = self._members[k][:n]
            self._members[k] = grown
        self._members[k][n] = qid
        self._sizes[k] = n + 1
        self._slot[qid] = (k, n)

    def remove(self, qid: int) -> None:
        k, i = self._slot.pop(qid)
        last = int(self._sizes[k]) - 1
        if i != last:
            moved = int(self._members[k][last])
            self._members[k][i] = moved
            self._slot[moved] = (k, i)
        self._sizes[k] = last

    def draw(self, k: int, count: int, rng: np.random.Generator) -> list[int]:
        """`count` distinct members of bucket k, uniformly without replacement (O(count))."""
        n = int(self._sizes[k])
        if count > n:
            raise ValueError(f"bucket {k} holds {n} questions, asked for {count}")
        if count <= 0:
            return []
        slots = rng.choice(n, size=count, replace=False)
        return [int(q) for q in self._members[k][slots]]
