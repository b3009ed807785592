"""MEGALAUNCH_PROFILE_STARTUP=DIR: cProfile every rank from its entry to the end of its first iteration
(bench/goodput.py --profile); off by default."""

from __future__ import annotations

import os
from pathlib import Path

PROFILE_ENV = "MEGALAUNCH_PROFILE_STARTUP"


class StartupProfile:
    """Writes DIR/startup-<job>-rank<N>.prof (pstats) and .txt (top functions by cumulative time).
    For finding where start-up goes."""

    def __init__(self, out: Path) -> None:
        import cProfile

        self.out = out
        self.profile = cProfile.Profile()
        self.profile.enable()

    @classmethod
    def start(cls) -> StartupProfile | None:
        out = os.environ.get(PROFILE_ENV)
        return cls(Path(out)) if out else None

    def dump(self, rank: int, job_id: str | None) -> None:
        import io
        import pstats

        self.profile.disable()
        stem = self.out / f"startup-{job_id or 'nojob'}-rank{rank}"
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self.profile.dump_stats(f"{stem}.prof")
            text = io.StringIO()
            pstats.Stats(self.profile, stream=text).sort_stats("cumulative").print_stats(60)
            Path(f"{stem}.txt").write_text(text.getvalue())
        except OSError as e:
            print(f"[megalaunch rank {rank}] start-up profile not written: {e}", flush=True)
