"""A workload that records what each task sees of the rank environment (multi-node tests)."""

from __future__ import annotations

import socket
import sys

from megalaunch.rundir.files import atomic_write_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import write_outcome
from megalaunch.runtime.rank.dist_env import export_rank_env


def main() -> int:
    r = export_rank_env()
    paths = RunPaths.from_env()
    import os

    atomic_write_json(paths.debug / f"rank-{r.rank}.json", {
        "rank": r.rank, "local_rank": r.local_rank, "world_size": r.world_size, "master_addr": r.master_addr,
        "master_port": r.master_port, "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    })
    if r.rank == 0:
        write_outcome(paths, "finished", iteration=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
