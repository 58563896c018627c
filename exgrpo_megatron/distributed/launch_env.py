"""Where this process sits in the job: rank, world size and rendezvous, from torchrun or Slurm.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. Under `srun` (one task per GPU)
Slurm sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and SLURM_JOB_NODELIST; the master is the
first host of the node list. A plain `python` process is rank 0 of 1; without MASTER_PORT it rendezvouses on a
free port (`free_local_port`: two single-process runs on one machine must not collide on 29500). torchrun and Slurm
keep the launcher's port: every rank must agree on it.
"""

from __future__ import annotations

import os
import random
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"


def first_host(nodelist: str) -> str:
    """First hostname of a Slurm node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty SLURM_JOB_NODELIST")
    m = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if m is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "")),
            master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            launcher="slurm",
        )
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else free_local_port()
    return LaunchEnv(0, 1, 0, "127.0.0.1", port, "single")


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, drawn at random below the OS's ephemeral range: a port from that
    range (the OS hands them to outgoing connections, and gloo opens many) could be taken by another process's
    connection between this check and the store's bind. Outside Linux (or with no room below the range): one the OS
    picks."""
    low = ephemeral_port_low()
    if low > 2048:  # else no room below the range: take the OS's pick
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(max(1024, low // 2), low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ephemeral_port_low() -> int:
    """The first port of the OS's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range), 0 if unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
