"""Plain data objects that cross the experience pool's boundary.

Trajectories are stored as token ids, never text: the recorded behaviour log-probs stay aligned
with the exact sampled tokens (docs/exgrpo.md: the original decode -> re-encode round trip
can misalign them silently).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike


class Trajectory:
    """One correct response of a question, as sampled (treat as immutable).

    token_ids: np.int32 [L], the response tokens including the final EOS (no prompt, no padding).
    logprobs: np.float32 [L], log pi_behaviour(token_t | prefix) of every response token at collection.
    step: the trainer step at which it was collected. length: L.
    digest: hash of the token-id bytes, for de-duplication inside this process only (python's bytes
      hash is salted per process: never persist it; equal digests are re-checked element-wise).
    """

    __slots__ = ("token_ids", "logprobs", "step", "length", "digest")

    def __init__(self, token_ids: np.ndarray, logprobs: np.ndarray, step: int) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.step = step
        self.length = int(token_ids.shape[0])
        self.digest = hash(token_ids.tobytes())

    def same_tokens(self, other: Trajectory) -> bool:
        return self.digest == other.digest and np.array_equal(self.token_ids, other.token_ids)

    def __repr__(self) -> str:
        return f"Trajectory(length={self.length}, step={self.step}, token_ids={self.token_ids[:8].tolist()}...)"


def _as_1d(values: ArrayLike, dtype: type[np.generic]) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == dtype and values.ndim == 1 and values.flags.c_contiguous:
        return values  # fast path: already in storage layout
    return np.ascontiguousarray(values, dtype=dtype).reshape(-1)


def as_trajectory(token_ids: ArrayLike, logprobs: ArrayLike, step: int) -> Trajectory:
    """Validate and normalise dtypes (int32 ids, float32 log-probs, equal 1-D lengths)."""
    ids = _as_1d(token_ids, np.int32)
    lps = _as_1d(logprobs, np.float32)
    if ids.shape != lps.shape:
        raise ValueError(f"token_ids ({ids.shape[0]}) and logprobs ({lps.shape[0]}) differ in length")
    if ids.shape[0] == 0:
        raise ValueError("empty trajectory")
    return Trajectory(ids, lps, int(step))


@dataclass(slots=True)
class GroupOutcome:
    """What one rollout group of a question taught the pool.

    qid: the question id (int). k_correct: rewards == 1 among the group's `group_size` (K) responses
    (for a replay group the replayed trajectory counts too). correct_token_ids / correct_logprobs: the
    correct responses (token ids incl. EOS, behaviour log-probs), parallel lists. step: trainer step.
    """

    qid: int
    k_correct: int
    group_size: int
    correct_token_ids: list[np.ndarray] = field(default_factory=list)
    correct_logprobs: list[np.ndarray] = field(default_factory=list)
    step: int = 0

    def trajectories(self) -> list[Trajectory]:
        if len(self.correct_token_ids) != len(self.correct_logprobs):
            raise ValueError(f"question {self.qid}: {len(self.correct_token_ids)} token arrays vs "
                             f"{len(self.correct_logprobs)} log-prob arrays")
        pairs = zip(self.correct_token_ids, self.correct_logprobs, strict=True)
        return [as_trajectory(t, lp, self.step) for t, lp in pairs]


@dataclass(frozen=True, slots=True)
class ReplayChoice:
    """One replayed question of a step: the chosen stored trajectory and the bucket it was drawn from.

    current_logprobs: np.float32 [L], the selection pass's log-probs of the trajectory's tokens under the CURRENT
    policy at the scorer's `logprob_temperature` (the trainer's pi_old for the replayed row, see
    policy/old_logprobs.py); None when the trajectory was not scored (single candidate, metric random) or the
    scorer was not asked for them.
    """

    qid: int
    trajectory: Trajectory
    bucket: int
    current_logprobs: np.ndarray | None = None  # log pi_theta of its tokens now, when the scorer computed them


@dataclass(frozen=True, slots=True)
class CandidateScores:
    """What a scorer returns for one question: one value per stored candidate, in the given order.

    mean_entropy[j] = (1/|o_j|) sum_t H(pi_theta(. | prefix_t)) over the response tokens of candidate j
      (EOS included) under the CURRENT policy at temperature 1 -- required for metric "ent".
    mean_nll[j] = -(1/|o_j|) sum_t log pi_theta(o_j,t | prefix_t) under the current policy -- required
      for metric "ppl" (perplexity = exp(mean_nll)).
    token_logprobs[j] = np.float32 [|o_j|], log pi_theta(o_j,t | prefix_t) under the current policy at the
      scorer's logprob temperature (the rollout temperature), kept so the chosen trajectory's pi_old needs no
      second forward pass; None when the scorer was not asked for them.
    A field the metric does not need may be None.
    """

    mean_entropy: np.ndarray | None = None
    mean_nll: np.ndarray | None = None
    token_logprobs: list[np.ndarray] | None = None
