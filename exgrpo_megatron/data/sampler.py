"""The resumable fresh-prompt sampler: epochs of seeded permutations, skipping retired questions.

Each epoch ``e`` visits the qids in the order ``perm_e = Generator(PCG64(SeedSequence([seed, e]))).permutation``
(or the given order when ``shuffle=False``). ``draw(n, skip)`` walks that order from the saved position and
returns the next ``n`` ids that are not in ``skip`` (the global retired set, docs/exgrpo.md); ids met
in ``skip`` are passed over for the rest of this epoch. Only what is returned is consumed: the reference code
loaded B fresh prompts per step and discarded the ones replaced by replays (§2, §6 item 7); here the trainer
asks for exactly ``B - n_exp`` and dataset coverage is preserved.

Guarantees (given ``|qids \\ skip| >= n``):
* the ``n`` ids of one draw are distinct and none is in ``skip``;
* every non-retired id is returned exactly once per epoch;
* when an epoch runs out mid-draw the draw continues into the next epoch; an id of the new epoch that was
  already returned earlier in the *same* draw is **deferred**: kept (in ``state_dict()["deferred"]``) and
  returned first by the next draw, so it still appears exactly once in its epoch;
* ``state_dict()`` / ``load_state_dict()`` round-trip exactly: a resumed sampler returns the same sequence
  the uninterrupted one would have (no prompt replayed or skipped);
* the sampler is a pure function of (qids, seed, state, n, skip): every rank computes the same draw.

If fewer than ``n`` ids outside ``skip`` remain, ``draw`` raises :class:`SamplerExhausted` (no repeats are
invented) and the sampler's state is left unchanged.
"""

from __future__ import annotations

import zlib
from collections.abc import Container, Sequence
from typing import Any

import numpy as np

STATE_VERSION = 1


class SamplerExhausted(RuntimeError):
    """Fewer questions outside the retired set than one draw needs."""


def epoch_order(num_ids: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Index order of epoch ``epoch``: a permutation seeded by (seed, epoch), or the identity."""
    if not shuffle:
        return np.arange(num_ids, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_ids).astype(np.int64)


def qids_fingerprint(qids: Sequence[int]) -> str:
    """CRC32 of the qid list (order included), to catch a resume over a different dataset."""
    return f"{zlib.crc32(np.asarray(qids, dtype=np.int64).tobytes()):08x}"


class PromptSampler:
    """Epoch-based seeded sampler over ``qids``; see the module docstring for the contract."""

    def __init__(self, qids: Sequence[int], seed: int, shuffle: bool = True) -> None:
        if len(qids) == 0:
            raise ValueError("PromptSampler needs at least one qid")
        if seed < 0:
            raise ValueError(f"PromptSampler seed must be >= 0, got {seed}")
        self.qids = np.asarray(qids, dtype=np.int64)
        if len(np.unique(self.qids)) != len(self.qids):
            raise ValueError("PromptSampler qids must be distinct")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0  # next index into the current epoch's order
        self.deferred: list[int] = []  # ids of the current epoch returned first by the next draw
        self.num_drawn = 0  # ids returned so far, over all draws
        self._fingerprint = qids_fingerprint(self.qids.tolist())
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.qids)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, self.qids[epoch_order(len(self.qids), self.seed, epoch, self.shuffle)])
        return self._order_cache[1]

    @property
    def epoch_progress(self) -> float:
        """Epochs completed as a float (epoch + fraction of the current one walked), for logging."""
        return self.epoch + self.position / len(self.qids)

    def draw(self, n: int, skip: Container[int] = frozenset()) -> list[int]:
        """The next ``n`` distinct ids not in ``skip``; raises SamplerExhausted (state unchanged) if impossible."""
        if n < 0:
            raise ValueError(f"draw(n={n}): n must be >= 0")
        if n == 0:
            return []
        out: list[int] = []
        chosen: set[int] = set()
        # Deferred ids belong to the current epoch and come first.
        deferred = [q for q in self.deferred if q not in skip]
        take, deferred = deferred[:n], deferred[n:]
        out.extend(take)
        chosen.update(take)
        new_deferred: list[int] = deferred
        epoch, position = self.epoch, self.position
        order = self._order(epoch)
        boundaries_crossed = 0
        while len(out) < n:
            if position == len(order):
                if boundaries_crossed == 1:
                    # With >= n usable ids a draw ends within the epoch after the one it started in
                    # (the new epoch holds every usable id not yet chosen), so a second boundary means < n.
                    self._raise_exhausted(n, skip)
                epoch, position, boundaries_crossed = epoch + 1, 0, boundaries_crossed + 1
                order = self._order(epoch)
                continue
            qid = int(order[position])
            position += 1
            if qid in skip:
                continue
            if qid in chosen:  # met again in the next epoch within the same draw
                new_deferred.append(qid)
                continue
            out.append(qid)
            chosen.add(qid)
        self.epoch, self.position, self.deferred = epoch, position, new_deferred
        self.num_drawn += n
        return out

    def _raise_exhausted(self, n: int, skip: Container[int]) -> None:
        available = sum(1 for q in self.qids.tolist() if q not in skip)
        raise SamplerExhausted(
            f"PromptSampler: a draw needs {n} distinct questions but only {available} of {len(self.qids)} are "
            f"not retired; use a larger dataset or a smaller trainer.train_batch_size")

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: epoch, position, deferred ids, seed, shuffle, and a fingerprint of the qids."""
        return {"version": STATE_VERSION, "seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch,
                "position": self.position, "deferred": list(self.deferred), "num_drawn": self.num_drawn,
                "num_qids": len(self.qids), "qids_fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore a saved state. ``strict`` (default) requires the same seed, shuffle flag and qid list; with
        ``strict=False`` a mismatch only clamps the position (the continuation is then not exact)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"PromptSampler state version {state.get('version')!r}, expected {STATE_VERSION}")
        mismatches = [f"{key}: saved {state[key]!r}, now {now!r}" for key, now in
                      (("seed", self.seed), ("shuffle", self.shuffle), ("num_qids", len(self.qids)),
                       ("qids_fingerprint", self._fingerprint)) if state[key] != now]
        if mismatches and strict:
            raise ValueError("PromptSampler state does not match this dataset/seed (" + "; ".join(mismatches)
                             + "); pass strict=False to resume approximately")
        self.epoch = int(state["epoch"])
        self.position = min(int(state["position"]), len(self.qids))
        valid = set(self.qids.tolist())
        self.deferred = [int(q) for q in state["deferred"] if int(q) in valid]
        self.num_drawn = int(state.get("num_drawn", 0))
