"""The evaluations of a run: RUN/evals/<iteration>/ holds one eval stage's files.

    state.json      queued | submitted | running | done | failed, with the job id, why, when
    results.json    the results (written last, atomically: its presence means done)
    eval.sbatch     the Slurm job script (Slurm backend)          logs/   the job's log
    hf/             the converted Hugging Face model (deleted when done unless eval.keep_hf)

The trainer (rank 0) queues an iteration, the eval stage (evaluation/) runs it, `status --evals` and
`eval status` read it. Plain files, atomic writes: every command can be re-run."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.rundir.files import atomic_write_json, read_json
from megalaunch.rundir.paths import RunPaths

STATES = ("queued", "submitted", "running", "done", "failed")
ACTIVE = ("queued", "submitted", "running")


@dataclass(frozen=True)
class EvalPaths:
    run: RunPaths
    iteration: int

    @property
    def root(self) -> Path:
        return self.run.evals / f"{self.iteration:07d}"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def results(self) -> Path:
        return self.root / "results.json"

    @property
    def job_script(self) -> Path:
        return self.root / "eval.sbatch"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    def read_state(self) -> dict[str, Any] | None:
        data = read_json(self.state)
        return data if isinstance(data, dict) else None

    def write_state(self, state: str, **data: Any) -> dict[str, Any]:
        assert state in STATES, state
        self.root.mkdir(parents=True, exist_ok=True)
        previous = self.read_state() or {}
        record = {**{k: v for k, v in previous.items() if k in ("job_id", "attempt", "queued_at")},
                  "iteration": self.iteration, "state": state, "time": time.time(), **data}
        if state == "queued":
            record["attempt"] = int(previous.get("attempt", 0)) + 1
            record.setdefault("queued_at", record["time"])
        atomic_write_json(self.state, record)
        return record


def eval_iterations(run: RunPaths) -> list[int]:
    """Iterations that have an eval directory, ascending."""
    try:
        names = os.listdir(run.evals)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if n.isdigit())


def eval_records(run: RunPaths) -> list[dict[str, Any]]:
    """One record per evaluated iteration: its state, reason, job id and (when done) its headline
    numbers, for `eval status` and `status --evals`."""
    out = []
    for it in eval_iterations(run):
        ep = EvalPaths(run, it)
        state = ep.read_state() or {"state": "queued", "iteration": it}
        results = read_json(ep.results)
        record: dict[str, Any] = {"iteration": it, "state": state.get("state"), "job_id": state.get("job_id"),
                                  "reason": state.get("reason"), "time": state.get("time"),
                                  "attempt": state.get("attempt")}
        if isinstance(results, dict):
            record["heldout_ppl"] = (results.get("heldout") or {}).get("ppl")
            record["tasks"] = {name: t.get("acc") for name, t in (results.get("tasks") or {}).items()}
            record["wall_s"] = results.get("wall_s")
            record["tokens"] = results.get("tokens")
        out.append(record)
    return out


def queued(run: RunPaths) -> list[int]:
    """Iterations queued and not yet submitted or run, oldest first."""
    return [it for it in eval_iterations(run) if (EvalPaths(run, it).read_state() or {}).get("state") == "queued"]


def pending_iterations(run: RunPaths) -> set[int]:
    """Iterations whose eval has not finished: retention keeps their checkpoints."""
    return {r["iteration"] for r in eval_records(run) if r["state"] in ACTIVE}


def format_eval_records(records: list[dict[str, Any]]) -> list[str]:
    """Human lines: `iteration 50: done  ppl 123.4  arith acc 0.50  (41 s)` or the failure's reason."""
    lines = []
    for r in records:
        text = f"iteration {r['iteration']}: {r['state']}"
        if r.get("job_id"):
            text += f" (job {r['job_id']})"
        if r["state"] == "done":
            if r.get("heldout_ppl") is not None:
                text += f"  held-out ppl {r['heldout_ppl']:.3f}"
            for name, acc in (r.get("tasks") or {}).items():
                text += f"  {name} acc {acc:.3f}" if isinstance(acc, float) else f"  {name} {acc}"
            if r.get("wall_s") is not None:
                text += f"  ({r['wall_s']:.0f} s)"
        elif r.get("reason"):
            text += f": {r['reason']}"
        lines.append(text)
    return lines
