"""Which DP rank owns a question, and the collectives that move groups and choices between ranks.

Ownership: owner_rank(q, dp) = splitmix64(q) mod dp -- a fixed integer hash (never python `hash()`,
which is salted per process for str and would differ across ranks/restarts), so every rank, and every
restart at any DP size, agrees on the owner without communication.

Routing a step's groups (`route_groups`), two collectives over the DP group:
  1. all_gather_object of a small int64 header per group (qid, k, K, step, #trajectories, #tokens):
     every rank learns every group's outcome, so all ranks retire the same questions in the same order
     and the retired set stays identical everywhere;
  2. all_to_all_single of one int32 payload (trajectory lengths, token ids, float32 log-prob bits):
     a group's trajectories travel only to the rank that owns the question (traffic ~ 1/dp of an
     all-gather).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from exgrpo_megatron.experience.types import GroupOutcome, Trajectory

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64 finaliser (Steele, Lea, Flood 2014) of a 64-bit integer (negative ints wrap)."""
    z = (int(x) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def owner_rank(qid: int, dp_size: int) -> int:
    """The DP rank that stores question `qid`."""
    return splitmix64(qid) % dp_size if dp_size > 1 else 0


# A routed group: (qid, k_correct, group_size, step, trajectories -- empty on ranks that do not own it).
RoutedGroup = tuple[int, int, int, int, list[Trajectory]]

_HEADER_COLUMNS = 6  # qid, k_correct, group_size, step, n_trajectories, n_tokens


def _headers(groups: list[GroupOutcome], trajectories: list[list[Trajectory]]) -> np.ndarray:
    rows = [(g.qid, g.k_correct, g.group_size, g.step, len(ts), sum(t.length for t in ts))
            for g, ts in zip(groups, trajectories, strict=True)]
    return np.asarray(rows, dtype=np.int64).reshape(-1, _HEADER_COLUMNS)


def _payload_size(header_row: np.ndarray) -> int:
    return int(header_row[4] + 2 * header_row[5])


def _encode(trajectories: list[Trajectory]) -> np.ndarray:
    lengths = np.asarray([t.length for t in trajectories], dtype=np.int32)
    parts = [lengths] + [t.token_ids for t in trajectories] + [t.logprobs.view(np.int32) for t in trajectories]
    return np.concatenate(parts) if trajectories else np.zeros(0, np.int32)


def _decode(buf: np.ndarray, n_trajectories: int, step: int) -> list[Trajectory]:
    lengths = buf[:n_trajectories].astype(np.int64)
    offsets = n_trajectories + np.concatenate([[0], np.cumsum(lengths)])
    n_tokens = int(lengths.sum())
    out = []
    for j in range(n_trajectories):
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        out.append(Trajectory(buf[lo:hi].copy(), buf[lo + n_tokens:hi + n_tokens].view(np.float32).copy(), step))
    return out


def route_groups(groups: list[GroupOutcome], dp_group: dist.ProcessGroup | None, dp_rank: int, dp_size: int
                 ) -> list[RoutedGroup]:
    """Every group of every DP rank, in (source rank, local index) order -- identical on all ranks --
    with its trajectories attached only on the rank that owns the question."""
    local_trajs = [g.trajectories() for g in groups]
    if dp_size == 1:
        return [(g.qid, g.k_correct, g.group_size, g.step, ts) for g, ts in zip(groups, local_trajs, strict=True)]
    gathered_headers: list[np.ndarray | None] = [None] * dp_size
    dist.all_gather_object(gathered_headers, _headers(groups, local_trajs), group=dp_group)
    all_headers = cast(list[np.ndarray], gathered_headers)  # every entry filled by the all-gather
    owners = [[owner_rank(int(q), dp_size) for q in h[:, 0]] for h in all_headers]

    send_parts: list[list[np.ndarray]] = [[] for _ in range(dp_size)]
    for i, ts in enumerate(local_trajs):
        send_parts[owners[dp_rank][i]].append(_encode(ts))
    send_sizes = [sum(p.shape[0] for p in parts) for parts in send_parts]
    recv_sizes = [sum(_payload_size(row) for row, o in zip(h, own, strict=True) if o == dp_rank)
                  for h, own in zip(all_headers, owners, strict=True)]
    flat_send = [p for parts in send_parts for p in parts]
    send = torch.from_numpy(np.concatenate(flat_send) if flat_send else np.zeros(0, np.int32))
    recv = torch.empty(sum(recv_sizes), dtype=torch.int32)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=dp_group)
    received = recv.numpy()

    routed: list[RoutedGroup] = []
    cursor = 0
    for h, own in zip(all_headers, owners, strict=True):
        for row, o in zip(h, own, strict=True):
            qid, k, size, step, n_traj = (int(v) for v in row[:5])
            trajs: list[Trajectory] = []
            if o == dp_rank:
                n = _payload_size(row)
                trajs = _decode(received[cursor:cursor + n], n_traj, step)
                cursor += n
            routed.append((qid, k, size, step, trajs))
    return routed


def all_gather_choices(local: list[tuple[int, int, Trajectory, np.ndarray | None]],
                       dp_group: dist.ProcessGroup | None, dp_size: int
                       ) -> list[tuple[int, int, Trajectory, np.ndarray | None]]:
    """Concatenate every rank's (qid, bucket, trajectory, current log-probs) choices on every rank
    (all_gather_object)."""
    if dp_size == 1:
        return list(local)
    packed = [(q, k, t.token_ids, t.logprobs, t.step, cur) for q, k, t, cur in local]
    gathered: list[list[Any] | None] = [None] * dp_size
    dist.all_gather_object(gathered, packed, group=dp_group)
    parts = cast(list[list[Any]], gathered)  # every entry filled by the all-gather
    return [(q, k, Trajectory(ids, lps, step), cur) for part in parts for q, k, ids, lps, step, cur in part]


def all_gather_int64(values: np.ndarray, dp_group: dist.ProcessGroup | None, dp_size: int) -> np.ndarray:
    """Stack a fixed-length int64 vector from every rank: [dp_size, len]."""
    if dp_size == 1:
        return np.asarray(values, dtype=np.int64)[None, :]
    local = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    out = [torch.empty_like(local) for _ in range(dp_size)]
    dist.all_gather(out, local, group=dp_group)
    return torch.stack(out).numpy()
