"""The debug ledger of collectives (`parallel.collective_ledger: true`; off by default, and then nothing of it runs).

Every collective this rank issues in a step is recorded (collective_watch.py's wrappers): its number in the step,
the op, the process group (megatron's name for it and its ranks), the exgrpo_megatron call site (the innermost
exgrpo_megatron frame of the Python stack, `file:function`) and a pass name -- the caller's, given with
`collective_pass("name")`, else the trainer verb it runs under (`trainer.with_old_logprobs`). Ranks compare without
a collective of their own (one could be paired with the wrong call), through the process group's store:

* at each step's end (`collective_watch.check_step`, from the run loop) each rank publishes, per process group,
  its count of calls and a digest of their ops, and waits for every rank's; a group whose members disagree makes
  every rank publish its calls, name the first call that differs on each rank, and exit 5;
* while a collective (or that wait) has lasted LEDGER_WAIT_S, the rank publishes the calls of its step and the one
  it is blocked in; once the published ranks wait for each other in a cycle (each is blocked in a call that the
  next one never issued), or two of them issued different ops at the same position of one group, the run stops
  with exit 5 and the divergent calls named on each rank -- in seconds, not at the collective timeout.

Only the ops and groups decide that ranks diverged; call sites and pass names only name the calls. Point-to-point
sends between pipeline stages are not collectives and are not recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

LEDGER_WAIT_S = 3.0  # a collective this old publishes the rank's ledger
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
OWN_FILES = ("collective_watch.py", "collective_ledger.py")
TRAINER = os.path.join(PACKAGE_DIR, "training", "trainer.py")
_pass_name = threading.local()
_agreement = threading.local()  # the pass site a lockstep agreement is made for (distributed/lockstep.py)


@contextlib.contextmanager
def _labelled(slot: threading.local, value: str) -> Iterator[None]:
    """`slot.value` is `value` inside the block (restored after, so blocks nest)."""
    before = getattr(slot, "value", None)
    slot.value = value
    try:
        yield
    finally:
        slot.value = before


def collective_pass(name: str) -> contextlib.AbstractContextManager[None]:
    """The collectives issued in the block carry the pass name `name` in the ledger."""
    return _labelled(_pass_name, name)


def agreement_for(site: str) -> contextlib.AbstractContextManager[None]:
    """The collectives issued in the block are the lockstep agreement of pass `site`: the site is part of the call's
    identity (ranks agreeing for different passes issue different calls, though the op and group are the same)."""
    return _labelled(_agreement, site)


def process_group(group: Any) -> dist.ProcessGroup:
    """The group a collective's `group` argument means (None: the default group)."""
    g = group if group is not None else dist.group.WORLD
    assert g is not None, "torch.distributed is not initialised"
    return g


def group_ranks(group: Any) -> list[int]:
    try:
        return list(dist.get_process_group_ranks(process_group(group)))
    except (RuntimeError, ValueError, AssertionError):  # a group this rank is not in: its call returns at once
        return []


def group_label(group: Any) -> str:
    """megatron's description of a process group (EXPERT_MODEL_PARALLEL_GROUP, ...), else torch's name for it."""
    g = process_group(group)
    return g.group_desc if g.group_desc not in ("", "undefined") else f"group {g.group_name}"


def describe_group(group: Any) -> str:
    return f"{group_label(group)} {group_ranks(group)}"


@dataclass(frozen=True)
class LedgerCall:
    number: int  # 1-based, in the step
    op: str
    group: str  # the process group's name (the same on every rank)
    group_desc: str
    ranks: tuple[int, ...]
    site: str
    pass_name: str

    def where(self) -> str:
        return f"{self.site} ({self.pass_name})" if self.pass_name else self.site

    def text(self) -> str:
        return f"call #{self.number} {self.op} on {self.group_desc} {list(self.ranks)} from {self.where()}"

    def row(self) -> list[Any]:
        return [self.number, self.op, self.group, self.group_desc, list(self.ranks), self.site, self.pass_name]

    @classmethod
    def of_row(cls, row: list[Any]) -> LedgerCall:
        return cls(int(row[0]), row[1], row[2], row[3], tuple(row[4]), row[5], row[6])


def call_site() -> tuple[str, str]:
    """(innermost exgrpo_megatron frame as `path:function`, the pass: the caller's name or the trainer verb)."""
    frame = sys._getframe(2)
    site, verb = "", ""
    while frame is not None:  # the innermost exgrpo_megatron frame, then the trainer verb above it
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE_DIR) and not path.endswith(OWN_FILES):
            if not site:
                site = f"{path[len(PACKAGE_DIR):]}:{frame.f_code.co_name}"
            if path == TRAINER and frame.f_code.co_name not in ("train_step", "train_step_ahead", "train_on"):
                verb = f"in trainer.{frame.f_code.co_name}"
                break
        frame = frame.f_back  # type: ignore[assignment]
    named = getattr(_pass_name, "value", None)
    agreed_for = getattr(_agreement, "value", None)
    site = (site or "(outside exgrpo_megatron)") + (f"[{agreed_for}]" if agreed_for else "")
    return site, f"pass {named!r}" if named else verb


class CollectiveLedger:
    """This rank's calls of the current step, and the comparisons (module doc)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.step = 0
        self.calls: list[LedgerCall] = []
        self.blocked: int | None = None  # index in calls of the one in flight; -1: the step-boundary wait
        self.published = False
        self._seen: list[str] | None = None

    def begin_step(self, step: int) -> None:
        self.step, self.calls = step, []

    def record(self, op: str, group: Any) -> LedgerCall:
        g = process_group(group)
        site, pass_name = call_site()
        call = LedgerCall(len(self.calls) + 1, op, g.group_name, group_label(g),
                          tuple(group_ranks(g)), site, pass_name)
        self.calls.append(call)
        self.blocked = len(self.calls) - 1
        return call

    def call_finished(self, store: dist.Store | None) -> None:
        self.blocked = None
        self._seen = None
        if self.published:
            self.published = False
            if store is not None:
                store.delete_key(f"blocked/{self.rank}")

    def state(self) -> str:
        return json.dumps({"step": self.step, "blocked": self.blocked, "calls": [c.row() for c in self.calls]})

    def recent(self, call: LedgerCall, n: int = 5) -> list[str]:
        """The last calls of this rank's step up to `call` (for the timeout's report)."""
        lines = [f"  rank {self.rank}, step {self.step}: {c.text()}" for c in self.calls[max(0, call.number - n):
                                                                                       call.number]]
        return [f"exgrpo-train: rank {self.rank}: its last collectives (the ledger):", *lines]

    def look_while_blocked(self, store: dist.Store, age: float) -> list[str] | None:
        """Publish this rank's ledger once a wait is LEDGER_WAIT_S old; the report once the published ledgers
        show a divergence twice in a row (half a second apart: a peer's state may have been a moment old)."""
        if age < LEDGER_WAIT_S or self.blocked is None:
            return None
        if not self.published:
            store.set(f"blocked/{self.rank}", self.state())
            self.published = True
        keys = {r: f"blocked/{r}" for r in range(self.world_size)}
        states = {r: read_state(store.get(k)) for r, k in keys.items() if store.check([k])}
        found = blocked_divergence(states)
        confirmed = found is not None and found == self._seen
        self._seen = found
        return [f"rank {self.rank}: {found[0]}", *found[1:]] if confirmed and found else None

    def check_step(self, store: dist.Store, step: int) -> list[str] | None:
        """Step boundary: the report when the ranks' per-group digests differ (every rank finds the same)."""
        digest = {c.group: [0, "", list(c.ranks)] for c in self.calls}
        for g in digest:
            ops = [c.op for c in self.calls if c.group == g]
            digest[g][:2] = [len(ops), hashlib.sha1("\n".join(ops).encode()).hexdigest()]
        store.set(f"step/{step}/digest/{self.rank}", json.dumps(digest))
        digests = gather(store, f"step/{step}/digest", self.world_size)
        if step > 2:
            for kind in ("digest", "calls"):
                store.delete_key(f"step/{step - 2}/{kind}/{self.rank}")
        if not any(differs(digests, g) for d in digests.values() for g in d):
            return None
        store.set(f"step/{step}/calls/{self.rank}", self.state())
        states = {r: read_state(raw) for r, raw in gather_raw(store, f"step/{step}/calls", self.world_size).items()}
        lines = first_difference(states) or ["  (the ranks' op counts per process group differ)"]
        return [f"rank {self.rank}: the collective ledger found ranks issuing different collectives in step {step}",
                "exgrpo-train: the first collective that differs between the ranks (the collective ledger):", *lines]


@dataclass
class RankState:
    step: int
    blocked: int | None
    calls: list[LedgerCall]

    def on_group(self, group: str) -> list[LedgerCall]:
        return [c for c in self.calls if c.group == group]


def read_state(raw: bytes) -> RankState:
    d = json.loads(raw)
    return RankState(int(d["step"]), d["blocked"], [LedgerCall.of_row(r) for r in d["calls"]])


def gather_raw(store: dist.Store, prefix: str, world_size: int) -> dict[int, bytes]:
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    while not store.check(keys):
        time.sleep(0.05)
    return {r: store.get(k) for r, k in enumerate(keys)}


def gather(store: dist.Store, prefix: str, world_size: int) -> dict[int, dict[str, list[Any]]]:
    return {r: json.loads(raw) for r, raw in gather_raw(store, prefix, world_size).items()}


def differs(digests: dict[int, dict[str, list[Any]]], group: str) -> bool:
    ranks = next(d[group][2] for d in digests.values() if group in d)
    seen = {tuple(digests[r].get(group, [0, ""])[:2]) if digests[r].get(group) else (0, "") for r in ranks}
    return len(seen) > 1


def first_difference(states: dict[int, RankState]) -> list[str]:
    """Each rank's call at the earliest position where the members of a process group issued different calls (op
    or call site), or where one of them issued none there (then: its call of the same number in the step, and how
    many it issued on that group); [] when the published ledgers agree."""
    best: tuple[int, list[str]] | None = None
    for group, ranks in {c.group: c.ranks for s in states.values() for c in s.calls}.items():
        members = [r for r in ranks if r in states]
        seqs = {r: states[r].on_group(group) for r in members}
        for k in range(max(len(s) for s in seqs.values())):
            at = {r: seqs[r][k] if k < len(seqs[r]) else None for r in members}
            if len({(c.op, c.site) if c else None for c in at.values()}) == 1:
                continue
            first = min(c.number for c in at.values() if c)
            if best is None or first < best[0]:
                best = (first, [f"  rank {r}: {c.text()}" if c else f"  rank {r}: {absent(states[r], first, seqs[r])}"
                                for r, c in at.items()])
            break
    return best[1] if best else []


def absent(state: RankState, number: int, on_group: list[LedgerCall]) -> str:
    own = state.calls[number - 1].text() if number <= len(state.calls) else f"no call #{number} in the step"
    group = f"{on_group[0].group_desc} " if on_group else ""
    return f"{own} (it issued only {len(on_group)} calls on that {group}group in step {state.step})"


def blocked_divergence(states: dict[int, RankState]) -> list[str] | None:
    """A report when the published, blocked ranks can never all finish: two issued different ops at one position
    of a group, or they wait for each other in a cycle (rank r -> q: r is blocked in a call of group G that q, a
    member of G blocked elsewhere, has not issued; or r waits at the step's end for q)."""
    steps = {s.step for s in states.values()}
    if len(states) < 2 or len(steps) != 1 or any(s.blocked is None for s in states.values()):
        return None
    cycle = find_cycle({r: waits_for(r, states) for r in states})
    if cycle is None and not mismatch_of_ops(states):
        return None
    step = steps.pop()
    lines = [f"exgrpo-train: where each rank is blocked (the collective ledger, step {step}):"]
    for r, s in sorted(states.items()):
        at = s.calls[s.blocked].text() if s.blocked is not None and s.blocked >= 0 else \
            f"waiting at the end of the step after {len(s.calls)} collectives"
        lines.append(f"  rank {r}: {at}")
    lines += ["exgrpo-train: the first collective that differs between the ranks:", *first_difference(states)]
    who = f"ranks {sorted(cycle)} wait for each other in different collectives" if cycle else \
        "ranks issued different collectives at the same position of a process group"
    return [f"the collective ledger found that {who} in step {step}", *lines]


def mismatch_of_ops(states: dict[int, RankState]) -> bool:
    for group, ranks in {c.group: c.ranks for s in states.values() for c in s.calls}.items():
        seqs = [states[r].on_group(group) for r in ranks if r in states]
        n = min(len(s) for s in seqs)
        if any(len({s[k].op for s in seqs}) > 1 for k in range(n)):
            return True
    return False


def waits_for(r: int, states: dict[int, RankState]) -> list[int]:
    s = states[r]
    if s.blocked == -1:  # the step-boundary wait: every rank still inside the step
        return [q for q, t in states.items() if q != r and t.blocked != -1]
    call = s.calls[s.blocked]  # type: ignore[index]
    position = len([c for c in s.calls[: s.blocked] if c.group == call.group])
    return [q for q in call.ranks if q != r and q in states and len(states[q].on_group(call.group)) <= position]


def find_cycle(waits: dict[int, list[int]]) -> list[int] | None:
    """A cycle of the wait-for graph among the published ranks (all of whose edges stay among them)."""
    for start in waits:
        path, seen = [start], {start}
        while True:
            nxt = [q for q in waits[path[-1]] if q in waits]
            if not nxt:
                break
            q = nxt[0]
            if q in seen:
                return path[path.index(q):]
            path.append(q)
            seen.add(q)
    return None
