"""The chain's last stage, `chain.export_hf` (on by default in the SFT recipes): when training reached its
target, `job end` converts the final checkpoint into a Hugging Face model in RUN/hf with `convert
mcore-to-hf` (weights, config, the run's frozen tokenizer with its chat template), as a process of its own
(no torch in `job end`). A failed export does not undo the training: the ledger's `exported` event says
why, and the same command, run by hand, retries it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megalaunch.launcher.chain.first_stage import run_stage
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

HF_EXPORT = "hf"


def export_dir(root: Path) -> Path:
    return root / HF_EXPORT


def export_hf(paths: RunPaths, job_id: str, log: Callable[[str], None]) -> bool:
    """Convert the run's last checkpoint into RUN/hf; records `exported` (ok or the one-line error)."""
    out, iteration = export_dir(paths.root), paths.read_tracker()
    log(f"last stage: converting checkpoint iteration {iteration} into a Hugging Face model in {out}")
    command = ["convert", "mcore-to-hf", str(paths.root), "--out", str(out), "--no-progress", "--overwrite"]
    ok, why, seconds = run_stage(command)
    record = {"output": str(out)} if ok else {"error": why, "fix": f"megalaunch {' '.join(command)}"}
    Ledger(paths).append("exported", job_id=job_id, ok=ok, iteration=iteration, seconds=seconds, **record)
    log(f"last stage: Hugging Face model written to {out} in {seconds} s" if ok
        else f"last stage: the Hugging Face export failed: {why}; retry: megalaunch {' '.join(command)}")
    return ok
