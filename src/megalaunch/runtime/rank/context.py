"""Who this process is in the segment, and its two outlets every room shares: its log lines
(`[megalaunch rank R] ...`, every rank) and the run's ledger (rank 0 only)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from megalaunch.rundir.files import append_jsonl
from megalaunch.rundir.paths import RunPaths


@dataclass(frozen=True)
class RankContext:
    paths: RunPaths
    rank: int
    world: int
    job_id: str | None

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    def log(self, message: str) -> None:
        print(f"[megalaunch rank {self.rank}] {message}", flush=True)

    def ledger(self, event: str, **data: Any) -> None:
        if self.rank == 0:
            append_jsonl(self.paths.ledger, {"event": event, "time": time.time(), "job_id": self.job_id, **data})
