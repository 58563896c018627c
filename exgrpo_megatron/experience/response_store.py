"""The response store: each question's newest graded responses, for replay that generates nothing.

In-group replay (RePO) and rescue replay (AR3PO) add stored responses of a FRESH question to its group of K fresh
rollouts. What a store keeps per question, newest first:

    token ids (int32, EOS included), the recorded behaviour log-probs (float32, one per token), the reward and
    the step it was collected at,

at most `ResponseReplay.per_question` of them (r for in-group replay, 1 for rescue replay), successes only unless
`ResponseReplay.failures`. `StoredResponse` is one; `ResponseReplay.chosen` decides which a group gains.

Sharding (as the experience pool, experience/routing.py): question q lives on DP rank owner_rank(q, dp_size). Every
method below that says "collective" is called by every DP rank in the same order, with or without data:
  * `update(groups)`: each rank passes the groups it generated; one all_gather_object of the responses, each rank
    keeps the questions it owns, in (source rank, local order);
  * `fetch(qids)`: every rank passes the questions of its own groups; the requests are all-gathered, each owner
    answers for the questions it holds, and the answers are all-gathered (a rank need not own its questions);
  * `stats()`: the store's size, all-reduced.
`expire(step)` (staleness, `experience.max_age_steps` = A > 0): after step t's update a response collected at step
s with s + A < t + 1 is dropped (so a replayed response is at most A steps old), the experience pool's rule.
The state (`state_dict`) lists questions by qid, responses newest first: a resumed store is bitwise the saved one
and a run at another DP size reshards it (`load_state_dicts` keeps the questions it owns).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch.distributed as dist

from exgrpo_megatron.experience.routing import all_gather_int64, owner_rank

STORE_FORMAT = "exgrpo_response_store"
STORE_VERSION = 1


@dataclass(frozen=True)
class StoredResponse:
    """One graded response of a question as the store keeps it (treat as immutable)."""

    token_ids: np.ndarray  # int32 [L]
    logprobs: np.ndarray  # float32 [L]: log pi_behaviour of each token when it was sampled
    reward: float
    step: int  # the trainer step it was collected at (a pool file's: 0, the start of the run that reads it)

    @property
    def success(self) -> bool:
        return self.reward == 1.0


@dataclass(frozen=True)
class ResponseReplay:
    """Which stored responses a fresh group gains: up to `per_question`, newest first; successes only unless
    `failures`; with `rescue_only`, only a group whose fresh responses all fail gains (AR3PO)."""

    per_question: int
    failures: bool
    rescue_only: bool = False

    def keeps(self, response: StoredResponse) -> bool:
        """Is a response worth storing under this rule?"""
        return self.failures or response.success

    def chosen(self, stored: Sequence[StoredResponse], fresh_rewards: Sequence[float]) -> list[StoredResponse]:
        """The stored responses (newest first) the group with these fresh rewards gains."""
        if self.rescue_only and any(r == 1.0 for r in fresh_rewards):
            return []
        return [s for s in stored if self.keeps(s)][:self.per_question]


class ResponseStore:
    """Each owned question's newest responses (module docstring); dp_group None: one process owns everything."""

    def __init__(self, replay: ResponseReplay, max_age_steps: int = 0, dp_group: dist.ProcessGroup | None = None
                 ) -> None:
        if replay.per_question < 1 or max_age_steps < 0:
            raise ValueError("per_question must be >= 1 and max_age_steps >= 0 (0 = no bound)")
        self.replay = replay
        self.max_age_steps = max_age_steps
        self.dp_group = dp_group
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self._reset()

    def _reset(self) -> None:
        self._responses: dict[int, list[StoredResponse]] = {}
        self._expiry: list[tuple[int, int]] = []  # min-heap of (oldest collection step, qid)
        self.num_responses = 0  # kept up to date, so that the step's stats cost O(1)
        self.num_tokens = 0

    def owns(self, qid: int) -> bool:
        return owner_rank(qid, self.dp_size) == self.dp_rank

    def responses(self, qid: int) -> list[StoredResponse]:
        """This rank's stored responses of an owned question, newest first (none: [])."""
        return list(self._responses.get(qid, []))

    @property
    def num_questions(self) -> int:
        return len(self._responses)

    # ---------------------------------------------------------------- collectives
    def _all_gather(self, local: Any) -> list[Any]:
        if self.dp_size == 1:
            return [local]
        gathered: list[Any] = [None] * self.dp_size
        dist.all_gather_object(gathered, local, group=self.dp_group)
        return gathered

    def update(self, groups: Sequence[tuple[int, Sequence[StoredResponse]]]) -> None:
        """Store each group's responses (collective; every rank passes the groups it generated, in order). A group's
        responses become its question's newest; the oldest beyond `per_question` are evicted."""
        local = [(qid, [r for r in responses if self.replay.keeps(r)]) for qid, responses in groups]
        for part in self._all_gather(local):
            for qid, responses in part:
                if responses and self.owns(qid):
                    self._add(qid, list(responses))

    def _set(self, qid: int, stored: list[StoredResponse]) -> None:
        """The question's responses become `stored` (none: it leaves the store); the counts follow."""
        old = self._responses.pop(qid, [])
        self.num_responses += len(stored) - len(old)
        self.num_tokens += sum(r.token_ids.shape[0] for r in stored) - sum(r.token_ids.shape[0] for r in old)
        if stored:
            self._responses[qid] = stored

    def _add(self, qid: int, newest: list[StoredResponse]) -> None:
        stored = (newest + self._responses.get(qid, []))[:self.replay.per_question]
        self._set(qid, stored)
        if self.max_age_steps:
            heapq.heappush(self._expiry, (min(r.step for r in stored), qid))

    def fetch(self, qids: Sequence[int]) -> dict[int, list[StoredResponse]]:
        """The stored responses (newest first) of this rank's questions `qids` that have any (collective: every rank
        passes its own, possibly none). The requests are all-gathered, each owner answers its questions, and the
        answers are all-gathered."""
        wanted = {q for part in self._all_gather(list(qids)) for q in part}
        mine = {q: self._responses[q] for q in sorted(wanted) if q in self._responses and self.owns(q)}
        asked = set(qids)
        out: dict[int, list[StoredResponse]] = {}
        for part in self._all_gather(mine):
            out.update({q: v for q, v in cast(dict[int, list[StoredResponse]], part).items() if q in asked})
        return out

    def stats(self) -> dict[str, float]:
        """Store-wide questions, responses and tokens (collective)."""
        local = np.asarray([self.num_questions, self.num_responses, self.num_tokens], dtype=np.int64)
        total = all_gather_int64(local, self.dp_group, self.dp_size).sum(axis=0)
        return {"responses/questions": float(total[0]), "responses/stored": float(total[1]),
                "responses/stored_tokens": float(total[2])}

    def all_states(self) -> list[dict[str, Any]]:
        """Every DP shard's `state_dict`, in rank order (collective)."""
        return self._all_gather(self.state_dict())

    # ---------------------------------------------------------------- staleness
    def expire(self, step: int) -> int:
        """After step `step`'s update: drop every response collected before step + 1 - max_age_steps; returns how
        many this rank dropped (not a collective; no-op without a bound)."""
        if not self.max_age_steps:
            return 0
        cutoff = step + 1 - self.max_age_steps
        due: set[int] = set()
        while self._expiry and self._expiry[0][0] < cutoff:
            due.add(heapq.heappop(self._expiry)[1])
        dropped = 0
        for qid in sorted(due):
            stored = self._responses.get(qid)
            if stored is None:
                continue
            keep = [r for r in stored if r.step >= cutoff]
            dropped += len(stored) - len(keep)
            self._set(qid, keep)
            if keep:
                heapq.heappush(self._expiry, (min(r.step for r in keep), qid))
        return dropped

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """{"arrays": {name: np.ndarray}, "meta": json-able}: questions by qid, responses newest first; qids and
        counts int64 [Q], lengths and steps int64 [N], rewards float64 [N], token_ids int32 and logprobs float32
        [sum lengths]."""
        qids = sorted(self._responses)
        flat = [r for q in qids for r in self._responses[q]]
        arrays = {
            "qids": np.asarray(qids, dtype=np.int64),
            "counts": np.asarray([len(self._responses[q]) for q in qids], dtype=np.int64),
            "lengths": np.asarray([r.token_ids.shape[0] for r in flat], dtype=np.int64),
            "steps": np.asarray([r.step for r in flat], dtype=np.int64),
            "rewards": np.asarray([r.reward for r in flat], dtype=np.float64),
            "token_ids": np.concatenate([r.token_ids for r in flat]) if flat else np.zeros(0, np.int32),
            "logprobs": np.concatenate([r.logprobs for r in flat]) if flat else np.zeros(0, np.float32),
        }
        meta = {"format": STORE_FORMAT, "version": STORE_VERSION, "per_question": self.replay.per_question,
                "failures": self.replay.failures, "max_age_steps": self.max_age_steps,
                "dp_rank": self.dp_rank, "dp_size": self.dp_size}
        return {"arrays": arrays, "meta": meta}

    def load_state_dicts(self, states: Sequence[dict[str, Any]], step: Callable[[int], int] | None = None) -> None:
        """Replace the content with the owned questions of `states` (the shards saved at any DP size). `step` maps a
        saved collection step to this run's (a pool file's responses count as collected at step 0); the rule's cap
        and its success filter apply to what is loaded."""
        self._reset()
        for state in states:
            meta, arrays = state["meta"], state["arrays"]
            if meta.get("format") != STORE_FORMAT or int(meta.get("version", -1)) > STORE_VERSION:
                raise ValueError(f"not a response store state: {meta}")
            token_offsets = np.concatenate([[0], np.cumsum(arrays["lengths"])]).astype(np.int64)
            response_offsets = np.concatenate([[0], np.cumsum(arrays["counts"])]).astype(np.int64)
            for i, qid in enumerate(arrays["qids"].tolist()):
                if not self.owns(qid):
                    continue
                if qid in self._responses:
                    raise ValueError(f"question {qid} appears in two saved shards")
                stored = []
                for j in range(int(response_offsets[i]), int(response_offsets[i + 1])):
                    lo, hi = int(token_offsets[j]), int(token_offsets[j + 1])
                    saved_step = int(arrays["steps"][j])
                    stored.append(StoredResponse(np.array(arrays["token_ids"][lo:hi], dtype=np.int32),
                                                 np.array(arrays["logprobs"][lo:hi], dtype=np.float32),
                                                 float(arrays["rewards"][j]), step(saved_step) if step else saved_step))
                kept = [r for r in stored if self.replay.keeps(r)][:self.replay.per_question]
                if kept:
                    self._add(qid, kept)
