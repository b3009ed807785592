"""The launcher's side of checkpoint storage: what a run's checkpoints take on disk against the
prediction (`megalaunch status`), and a segment that ended on a full filesystem or exhausted quota
(`job end`: outcome `storage_full`; runtime/rank/storage.py says how one is recognised). A full filesystem
is not a node fault and no retry fixes it: no suspect node, no crash-loop budget spent, the chain
stops at once, and the ledger says which filesystem, how much was free, how much was needed, and the fix."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.config.planner.checkpoint_size import DiskPeak, recipe_peak
from megalaunch.config.schema import Recipe
from megalaunch.errors import MegalaunchError
from megalaunch.launcher.accounting.evidence import rank_errors
from megalaunch.rundir.files import read_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.storage import (
    STORAGE_FIX,
    Filesystem,
    filesystem_of,
    free_bytes,
    gb,
    storage_evidence,
)

LOG_TAIL_BYTES = 1 << 20  # the end of a segment's log is where the trainer's traceback is


def predicted_peak(paths: RunPaths, recipe: Recipe | None = None) -> DiskPeak | None:
    """The run's checkpoint size and peak from its current recipe (run.yaml, so after `resume --set`
    too) and the vocabulary frozen at submit; None for a workload run or a recipe this version cannot read."""
    from megalaunch.config.loader import load_run_recipe

    try:
        recipe = recipe or load_run_recipe(paths)
        if recipe.workload:
            return None
        tokenizer = (read_json(paths.manifest) or {}).get("tokenizer")
        vocab = tokenizer.get("vocab_size") if isinstance(tokenizer, dict) else None
        if vocab is None and recipe.data.tokenizer_type == "NullTokenizer":
            vocab = recipe.data.vocab_size
        peak = recipe_peak(recipe, vocab if isinstance(vocab, int) else None)
        from megalaunch.config.training.score_budget import scores_bytes

        blend = paths.root / "data_blend.txt"  # the stored scores of post-training (RUN/scores/**)
        scores = scores_bytes(recipe, blend.read_text() if blend.is_file() else None)
        return dataclasses.replace(peak, scores_bytes=scores) if scores else peak
    except (MegalaunchError, OSError, ValueError):
        return None


def disk_usage(directory: Path) -> int:
    """Bytes `directory` occupies, as `du` counts them (allocated blocks; links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def checkpoint_usage(paths: RunPaths, recipe: Recipe | None = None,
                     events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The checkpoints on disk (count, du of checkpoints/, why each is kept) beside the predicted size
    and peak, and the latest save the job skipped for want of space (`events`: the ledger's)."""
    from megalaunch.runtime.checkpoint.resume import checkpoint_iterations

    iterations = checkpoint_iterations(paths)
    peak = predicted_peak(paths, recipe)
    fs = filesystem_of(paths.checkpoints)
    # the saves skipped for want of room (not those the signal window skipped: the stop save took their place)
    skipped = [e for e in events or [] if e.get("event") == "save_skipped" and e.get("filesystem")]
    squeezed = [e for e in events or [] if e.get("event") == "retention_squeezed"]
    return {"count": len(iterations), "iterations": iterations, "bytes": disk_usage(paths.checkpoints),
            "predicted_bytes": peak.checkpoint.total if peak else None, "peak_bytes": peak.total if peak else None,
            "peak": peak.describe() if peak else None, "filesystem": fs.describe(),
            "free_bytes": free_bytes(paths.checkpoints), "kept": kept_checkpoints(paths, iterations),
            "last_skipped": skipped[-1] if skipped else None, "last_squeezed": squeezed[-1] if squeezed else None,
            "fix": storage_fix(paths),
            "scores_bytes": disk_usage(paths.root / "scores") + disk_usage(paths.root / "rollouts")}


def kept_checkpoints(paths: RunPaths, iterations: list[int]) -> dict[str, Any] | None:
    """Why each checkpoint on disk is there (runtime/retention.keep, the rule the job applies): kept by
    `keep_last`, milestones, waiting for an evaluation, and the rest (being written, or unfinished)."""
    from megalaunch.rundir.evals import pending_iterations
    from megalaunch.runtime.checkpoint.completeness import incomplete_reason
    from megalaunch.runtime.checkpoint.resume import iter_dir
    from megalaunch.runtime.checkpoint.retention import keep
    from megalaunch.runtime.rank.settings import RuntimeSettings

    try:
        settings = RuntimeSettings.load(paths)
        complete = [i for i in iterations if incomplete_reason(iter_dir(paths, i), full=False) is None]
        kept = keep(iterations, complete, keep_last=settings.keep_last, milestone_interval=settings.milestone_interval,
                    eval_pending=pending_iterations(paths))
    except (OSError, ValueError, TypeError):
        return None
    named = {*kept.last, *kept.milestones, *kept.waiting_eval}
    return {"keep_last_setting": settings.keep_last, "keep_last": kept.last, "milestones": kept.milestones,
            "waiting_eval": kept.waiting_eval, "other": [i for i in iterations if i not in named]}


def format_usage(usage: dict[str, Any] | None) -> list[str]:
    if not usage:
        return []
    its = usage["iterations"]
    shown = ", ".join(map(str, its[-6:])) + (" ..." if len(its) > 6 else "")
    line = f"  checkpoints: {usage['count']} on disk" + (f" (iterations {shown})" if its else "") + \
        f", {gb(usage['bytes'])} (du)"
    if usage.get("predicted_bytes"):
        line += f"; predicted {gb(usage['predicted_bytes'])} each, peak {usage['peak']}"
    lines = [line]
    if usage.get("scores_bytes"):  # post-training's stored scores (DPO's reference, a teacher's top-k)
        lines.append(f"  stored scores: {gb(usage['scores_bytes'])} (du of RUN/scores and GRPO's RUN/rollouts; in the peak above)")
    kept = usage.get("kept")
    if kept and its:
        setting = kept["keep_last_setting"]
        parts = [f"{len(kept['keep_last'])} by keep_last {setting}" if setting >= 1 else
                 f"{len(kept['keep_last'])} (keep_last {setting}: every one)"]
        parts += [f"{len(kept[k])} {what} ({', '.join(map(str, kept[k][-4:]))})" for k, what in
                  (("milestones", "milestones"), ("waiting_eval", "waiting for an evaluation"),
                   ("other", "being written or unfinished")) if kept[k]]
        lines.append("  kept: " + ", ".join(parts))
    lines.append(f"  disk: {usage['filesystem']}: {gb(usage['free_bytes'])} free")
    fix = usage.get("fix") or STORAGE_FIX
    skip = usage.get("last_skipped")
    if skip:
        short = (f"{skip['free_inodes']:,} free inodes, {skip.get('need_inodes', 0):,} needed"
                 if skip.get("free_inodes") is not None else
                 f"{gb(skip.get('free_bytes') or 0)} free, {gb(skip.get('need_bytes') or 0)} needed")
        lines.append(f"  warning: the {skip.get('kind')} save at iteration {skip.get('iteration')} was skipped "
                     f"(job {skip.get('job_id')}): filesystem {skip.get('filesystem')} ({skip.get('mount')}) had "
                     f"{short}; fix: {fix}")
    squeeze = usage.get("last_squeezed")
    if squeeze:
        lines.append(f"  warning: the {squeeze.get('kind')} save at iteration {squeeze.get('iteration')} fit only "
                     f"after retention deleted checkpoint(s) {squeeze.get('deleted')} beyond keep_last "
                     f"{squeeze.get('keep_last')} (job {squeeze.get('job_id')}); fix: {fix}")
    return lines


# --- job end: a segment that failed on a full filesystem ---------------------------------------------

@dataclass(frozen=True)
class StorageFull:
    evidence: str  # the line that shows it
    filesystem: Filesystem
    free_at_end: int  # bytes free when the segment ended (its unfinished save still there)
    checkpoint_bytes: float | None  # one checkpoint, predicted
    peak: DiskPeak | None

    def record(self, free_after_cleanup: int) -> dict[str, Any]:
        """The ledger's figures."""
        return {"filesystem": self.filesystem.device, "mount": self.filesystem.mount, "fstype": self.filesystem.fstype,
                "free_bytes": self.free_at_end, "free_after_cleanup_bytes": free_after_cleanup,
                "need_bytes": self.checkpoint_bytes, "peak_bytes": self.peak.total if self.peak else None,
                "evidence": self.evidence}

    def reason(self, free_after_cleanup: int) -> str:
        """'filesystem /dev/x (/mnt, tmpfs): 0.0 GB free when the segment ended, 0.5 GB after removing ...'"""
        need = f"; one checkpoint needs {gb(self.checkpoint_bytes)}" if self.checkpoint_bytes else ""
        peak = f", the run up to {gb(self.peak.total)} (keep_last {self.peak.keep_last})" if self.peak else ""
        return (f"{self.filesystem.describe()}: {gb(self.free_at_end)} free when the segment ended, "
                f"{gb(free_after_cleanup)} after removing its unfinished save{need}{peak} [{self.evidence}]")


def _log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def storage_full(paths: RunPaths, job_id: str, outcome: dict[str, Any] | None) -> StorageFull | None:
    """Whether segment `job_id` failed on a full filesystem or quota: the trainer's outcome (its status,
    or the reason of a failure), the ranks' own error records, or the end of the segment's log. Never
    raises: what cannot be read is no evidence (the chain's decision must not depend on it)."""
    try:
        return _storage_full(paths, job_id, outcome or {})
    except (OSError, ValueError, TypeError, MegalaunchError):
        return None


def _storage_full(paths: RunPaths, job_id: str, outcome: dict[str, Any]) -> StorageFull | None:
    texts = [str(outcome.get("reason") or "")] + [str(r.get("reason") or "") for r in rank_errors(paths, job_id)]
    evidence = next((e for t in texts if (e := storage_evidence(t)) is not None), None)
    if evidence is None and outcome.get("status") == "storage_full":
        evidence = str(outcome.get("reason") or "storage_full")
    if evidence is None:
        evidence = storage_evidence(_log_tail(paths.segment_log(job_id)))
    if evidence is None and (outcome or any(texts)):
        return None  # the trainer said why, and it was not storage
    peak = predicted_peak(paths)
    need = outcome.get("need_bytes") if isinstance(outcome.get("need_bytes"), (int, float)) else None
    need = need or (peak.checkpoint.total if peak else None)
    free = free_bytes(paths.checkpoints)
    if evidence is None and need and free < need:
        # A full filesystem can keep the trainer from writing its outcome, error record and log at all
        # (they live on it too): a failed segment on a filesystem with less room than one checkpoint.
        evidence = f"{gb(free)} free, less than one checkpoint needs ({gb(need)}); the trainer left no reason"
    if evidence is None:
        return None
    return StorageFull(evidence=evidence, filesystem=filesystem_of(paths.checkpoints), free_at_end=free,
                       checkpoint_bytes=need, peak=peak)


def storage_fix(paths: RunPaths) -> str:
    return STORAGE_FIX.replace("RUN", str(paths.root))
