"""Rank environment inside a task. Under srun, RANK/LOCAL_RANK/WORLD_SIZE are derived from Slurm's
own variables in the task itself, so no shell sits between Slurm and the trainer (a shell would be
killed by the stop signal's default action)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int


def rank_env() -> RankEnv:
    e = os.environ
    rank = int(e.get("RANK", e.get("SLURM_PROCID", "0")))
    local = int(e.get("LOCAL_RANK", e.get("SLURM_LOCALID", "0")))
    world = int(e.get("WORLD_SIZE", e.get("SLURM_NTASKS", "1")))
    # one process on its own needs no agreed port: any free one (29500 may be taken by another run)
    port = e.get("MASTER_PORT") or (str(free_port()) if world == 1 else "29500")
    return RankEnv(rank=rank, local_rank=local, world_size=world,
                   master_addr=e.get("MASTER_ADDR", "127.0.0.1"), master_port=int(port))


def export_rank_env() -> RankEnv:
    """Set RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for torch.distributed's env:// init."""
    r = rank_env()
    os.environ.update({"RANK": str(r.rank), "LOCAL_RANK": str(r.local_rank), "WORLD_SIZE": str(r.world_size),
                       "MASTER_ADDR": r.master_addr, "MASTER_PORT": str(r.master_port)})
    return r


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free TCP port for a rendezvous on this host, chosen at random BELOW Linux's ephemeral range
    (32768+): a port the kernel handed out for bind(0) is also what outgoing connections (Slurm's
    own, say) get, and it can be taken before the trainer listens on it."""
    import random
    import socket

    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where there is none): what this host can still give
    to page cache (the checkpoint read-ahead) or pinned buffers (the save staging)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
