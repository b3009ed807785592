"""The chain's first stage: `data.chat_files` (`submit --data CHATS`) and `checkpoint.from_hf` (`submit
--from-hf DIR`).

Chat files are rendered and tokenized in the job, not at submit: `apply_chat_template` needs transformers,
which a login node's core install lacks, and a real SFT set takes minutes of CPU. `job begin` runs `data
sft CHATS --tokenizer RUN/tokenizer --output RUN/sft_data` (the run's frozen tokenizer, so the data's
tokenizer digest is the run's), then freezes RUN/data_blend.txt and records its sha256 in the manifest as
submit does for a blend given there. Once data_blend.txt exists, no segment tokenizes again.

`checkpoint.from_hf`: before the first segment
trains, `job begin` converts the Hugging Face model into RUN/pretrained with `convert hf-to-mcore` and
the run's own recipe (its model shape, tokenizer vocabulary and TP); training then starts from it
(Megatron's --pretrained-checkpoint, rendered by config/megatron_args.py). The conversion runs as a
process of its own (no torch in `job begin`), once: RUN/pretrained's tracker is written last, and a
segment that finds it (or a checkpoint of the run's own) converts nothing.

Distillation (post_training.method distill): after the chat data is tokenized, `job begin` scores it with
the teacher (`python -m megalaunch.runtime.scoring.teacher RUN`, a process of its own: transformers, the
GPU) into RUN/scores/teacher; a stage that stopped continues from the store's documents_done, and a store
complete for this teacher, top-k and data is not scored again."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.rundir.files import atomic_write_json, atomic_write_text, read_json
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

PRETRAINED = "pretrained"
SFT_DATA = "sft_data"
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
    ok, why, seconds = run_stage(["convert", "hf-to-mcore", hf_dir, "--out", str(out), "--recipe", str(paths.run_yaml),
                                  "--no-progress", "--overwrite"])
    if not ok or not (out / TRACKER).is_file():
        ledger("converted", job_id=job_id, source=hf_dir, ok=False, seconds=seconds, error=why)
        return Failed(f"converting checkpoint.from_hf {hf_dir} failed: {why}",
                      f"correct checkpoint.from_hf (a Hugging Face model of the recipe's shape), then "
                      f"megalaunch resume {paths.root}")
    ledger("converted", job_id=job_id, source=hf_dir, ok=True, seconds=seconds, output=str(out))
    log(f"first stage: converted in {seconds} s")
    return None


def stage_work_pending(paths: RunPaths, chat_files: str | None, from_hf: str | None,
                       post_training: dict[str, Any] | None) -> bool:
    """Whether `job begin` has first-stage work left (chat files to tokenize, a model to convert, a teacher's
    scores to store), cheaply: the chain queues the successor before such work (launcher/chain/chain.py)."""
    if chat_files and not paths.data_blend.is_file():
        return True
    if from_hf and paths.read_tracker() is None and not (pretrained_dir(paths.root) / TRACKER).is_file():
        return True
    if post_training and post_training.get("method") == "distill":
        return not (read_json(paths.root / "scores" / "teacher" / "meta.json") or {}).get("complete")
    return False


def run_stage(command: list[str], module: str = "megalaunch.cli.main") -> tuple[bool, str, float]:
    """Run one stage's command as a process of its own: (ok, its last line of error, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", module, *command], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    lines = [line for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip()]
    why = lines[-1].removeprefix("megalaunch: error: ") if lines else f"exit status {proc.returncode}"
    return proc.returncode == 0, why, round(time.monotonic() - start, 1)


def tokenize_chats(paths: RunPaths, chat_files: str, job_id: str, log: Callable[[str], None]) -> Failed | None:
    """Tokenize `chat_files` into RUN/sft_data and freeze the blend unless data_blend.txt exists; None when
    training may start, else why (one line) and the fix."""
    from megalaunch.data.blend import resolve_blend

    if paths.data_blend.is_file():
        return None
    out = paths.root / SFT_DATA
    log(f"first stage: tokenizing {chat_files} with the run's chat template into {out}")
    ok, why, seconds = run_stage(["data", "sft", chat_files, "--tokenizer", str(paths.tokenizer), "--output", str(out)])
    if ok:
        try:
            blend = resolve_blend([(str(out), None)])
            blend.check_files()
        except Exception as e:  # a MegalaunchError's one line, or what the file system said
            ok, why = False, getattr(e, "message", str(e))
    if not ok:
        Ledger(paths).append("data_prepared", job_id=job_id, source=chat_files, ok=False, seconds=seconds, error=why)
        return Failed(f"tokenizing data.chat_files {chat_files} failed: {why}",
                      f"correct the chat files (megalaunch data sft {chat_files} --tokenizer {paths.tokenizer} "
                      f"--output /tmp/check shows each bad row), then megalaunch resume {paths.root}")
    atomic_write_text(paths.data_blend, blend.text, mode=0o640)
    manifest = read_json(paths.manifest) or {}
    manifest["data_blend_sha256"] = blend.sha256
    manifest.setdefault("trusted_sha256", {})["data_blend.txt"] = blend.sha256
    atomic_write_json(paths.manifest, manifest, mode=0o640)
    Ledger(paths).append("data_prepared", job_id=job_id, source=chat_files, ok=True, seconds=seconds,
                         output=str(out), prefixes=len(blend.prefixes), blend_sha256=blend.sha256)
    log(f"first stage: chat data tokenized in {seconds} s ({len(blend.prefixes)} file(s))")
    return None


def score_teacher(paths: RunPaths, post_training: dict[str, Any] | None, job_id: str,
                  log: Callable[[str], None]) -> Failed | None:
    """Distillation: the teacher's top-k of the run's chat data into RUN/scores/teacher unless complete; None
    when training may start, else why the stage failed (one line) and the fix."""
    if not post_training or post_training.get("method") != "distill":
        return None  # before any import: a login node's core install runs `job begin` in tests (no numpy)
    from megalaunch.runtime.scoring.teacher import TeacherJob, TeacherRefused, is_complete, resolved_mode

    if resolved_mode(post_training) == "online":
        return None  # online: the teacher runs in the ranks' processes, nothing to store
    from megalaunch.runtime.scoring.store import read_meta

    try:
        job = TeacherJob.of_settings(paths, post_training)
        if is_complete(job):
            return None
    except TeacherRefused as e:
        reason, _, fix = str(e).partition("; fix: ")
        return Failed(reason, fix or f"megalaunch resume {paths.root} once fixed")
    log(f"first stage: scoring the chat data with the teacher {job.teacher} into {job.store}")
    ok, why, seconds = run_stage([str(paths.root)], module="megalaunch.runtime.scoring.teacher")
    meta = read_meta(job.store) or {}
    if not ok or not meta.get("complete"):
        Ledger(paths).append("teacher_scored", job_id=job_id, source=job.teacher, ok=False, seconds=seconds, error=why)
        reason, _, fix = why.partition("; fix: ")
        return Failed(f"the teacher stage failed: {reason}",
                      f"{fix or 'correct post_training.teacher'}, then megalaunch resume {paths.root}")
    Ledger(paths).append("teacher_scored", job_id=job_id, source=job.teacher, ok=True, seconds=seconds,
                         output=str(job.store), top_k=job.top_k, tokens=meta.get("tokens_scored"),
                         tokens_per_s=round(float(meta.get("tokens_per_s") or 0.0), 1))
    log(f"first stage: teacher scores in {seconds} s ({float(meta.get('tokens_per_s') or 0.0):.0f} tokens/s)")
    return None
