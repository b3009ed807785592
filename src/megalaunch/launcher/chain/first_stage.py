"""The chain's first stage for `checkpoint.from_hf` (`submit --from-hf DIR`): before the first segment
trains, `job begin` converts the Hugging Face model into RUN/pretrained with `convert hf-to-mcore` and
the run's own recipe (its model shape, tokenizer vocabulary and TP); training then starts from it
(Megatron's --pretrained-checkpoint, rendered by config/megatron_args.py). The conversion runs as a
process of its own (no torch in `job begin`), once: RUN/pretrained's tracker is written last, and a
segment that finds it (or a checkpoint of the run's own) converts nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

PRETRAINED = "pretrained"
TRACKER = "latest_checkpointed_iteration.txt"


def pretrained_dir(root: Path) -> Path:
    return root / PRETRAINED


@dataclass(frozen=True)
class Failed:
    reason: str
    fix: str


def convert_from_hf(paths: RunPaths, hf_dir: str, job_id: str, log: Callable[[str], None]) -> Failed | None:
    """Convert `hf_dir` into RUN/pretrained unless that is done or the run has checkpoints of its own;
    None when training may start, else why the conversion failed (one line) and the fix."""
    ledger = Ledger(paths).append
    out = pretrained_dir(paths.root)
    if paths.read_tracker() is not None or (out / TRACKER).is_file():
        return None
    log(f"first stage: converting {hf_dir} into {out}")
    command = [sys.executable, "-m", "megalaunch.cli.main", "convert", "hf-to-mcore", hf_dir, "--out", str(out),
               "--recipe", str(paths.run_yaml), "--no-progress", "--overwrite"]
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    seconds = round(time.monotonic() - start, 1)
    if proc.returncode != 0 or not (out / TRACKER).is_file():
        lines = [line for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip()]
        why = lines[-1].removeprefix("megalaunch: error: ") if lines else f"exit status {proc.returncode}"
        ledger("converted", job_id=job_id, source=hf_dir, ok=False, seconds=seconds, error=why)
        return Failed(f"converting checkpoint.from_hf {hf_dir} failed: {why}",
                      f"correct checkpoint.from_hf (a Hugging Face model of the recipe's shape), then "
                      f"megalaunch resume {paths.root}")
    ledger("converted", job_id=job_id, source=hf_dir, ok=True, seconds=seconds, output=str(out))
    log(f"first stage: converted in {seconds} s")
    return None
