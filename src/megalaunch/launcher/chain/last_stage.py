"""The chain's last stage, `chain.export_hf` (on by default in the SFT recipes): when training reached its
target, `job end` converts the final checkpoint into a Hugging Face model in RUN/hf with `convert
mcore-to-hf` (weights, config, the run's frozen tokenizer with its chat template), as a process of its own
(no torch in `job end`). A failed export does not undo the training: the ledger's `exported` event says
why, and the same command, run by hand, retries it.

A run fine-tuned from a Hugging Face directory (`--from-hf`) is exported as the model it came from: the
original config.json and generation_config.json, which the first stage's hf-to-mcore kept in
RUN/pretrained/hf_assets, are the export's template (`--hf-template`). So every key of the original config
survives (Llama 3's list of end-of-turn ids, Qwen3's sliding-window flags, the dtype, ...), and so does its
vocab_size: Qwen pads its embedding past its tokenizer (151936 rows for 151669 tokens); training holds only
the tokenizer's rows, so the rows past them come back as zeros, which no token id of the tokenizer reaches.
A tokenizer with more entries than config.json's vocab_size (special tokens added to it) grows the exported
vocabulary to hold their trained rows. The tokenizer and its chat template are the run's frozen ones
(RUN/tokenizer), as for every run: the template holds no tokenizer files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from megalaunch.config.tokenizer import resolve_tokenizer
from megalaunch.errors import MegalaunchError
from megalaunch.launcher.chain.first_stage import pretrained_dir, run_stage
from megalaunch.rundir.files import atomic_write_text
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

HF_EXPORT = "hf"
HF_ASSETS = "hf_assets"  # conversion/converter.py's ASSETS_DIR: hf-to-mcore's copy of config.json and tokenizer
TEMPLATE = ".hf_template"  # the export's --hf-template: the original's config, no tokenizer files
GENERATION_CONFIG = "generation_config.json"


def export_dir(root: Path) -> Path:
    return root / HF_EXPORT


def export_hf(paths: RunPaths, job_id: str, log: Callable[[str], None]) -> bool:
    """Convert the run's last checkpoint into RUN/hf; records `exported` (ok or the one-line error)."""
    out, iteration = export_dir(paths.root), paths.read_tracker()
    log(f"last stage: converting checkpoint iteration {iteration} into a Hugging Face model in {out}")
    command = ["convert", "mcore-to-hf", str(paths.root), "--out", str(out), "--no-progress", "--overwrite"]
    template = export_template(paths)
    if template is not None:
        command += ["--hf-template", str(template)]
    ok, why, seconds = run_stage(command)
    record = {"output": str(out)} if ok else {"error": why, "fix": f"megalaunch {' '.join(command)}"}
    Ledger(paths).append("exported", job_id=job_id, ok=ok, iteration=iteration, seconds=seconds, **record)
    log(f"last stage: Hugging Face model written to {out} in {seconds} s" if ok
        else f"last stage: the Hugging Face export failed: {why}; retry: megalaunch {' '.join(command)}")
    return ok


def export_template(paths: RunPaths) -> Path | None:
    """RUN/.hf_template for a --from-hf run: the original config.json (its vocab_size grown to the
    tokenizer's entries where the tokenizer has more) and generation_config.json, without tokenizer files,
    so that the export takes the run's own frozen tokenizer and chat template; None for any other run (its
    config is written from the checkpoint's arguments)."""
    assets = pretrained_dir(paths.root) / HF_ASSETS
    try:
        cfg = json.loads((assets / "config.json").read_text(encoding="utf-8"))
        rows = int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        entries = resolve_tokenizer(paths.tokenizer).vocab_size
    except MegalaunchError:
        entries = None
    template = paths.root / TEMPLATE
    shutil.rmtree(template, ignore_errors=True)
    template.mkdir()
    if (assets / GENERATION_CONFIG).is_file():
        shutil.copyfile(assets / GENERATION_CONFIG, template / GENERATION_CONFIG)
    cfg["vocab_size"] = max(rows, entries or 0)
    atomic_write_text(template / "config.json", json.dumps(cfg, indent=2) + "\n")
    return template
