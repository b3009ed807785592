"""A segment's end, before the chain decides (docs/architecture.md, "The chain"): its fate (status, reason
and fix) read from outcome.json, the ranks' ends, the cancel flag, the ledger and the disk, never from
the exit status alone; and what every end does whatever the decision: delete the saves it left
unfinished and rewrite the chain's goodput. `job end` (chain.py) judges a segment with it, `job
step-end` (restart.py) a step."""

from __future__ import annotations

from typing import Any

from megalaunch.launcher.accounting.evidence import TaskEnd, config_error, failure_reason
from megalaunch.launcher.chain.backend import Echo, cancelled_by
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths


def what_ended(paths: RunPaths, ledger: Ledger, job_id: str, outcome: dict[str, Any] | None, ends: list[TaskEnd],
               exit_code: int | None) -> tuple[str, Any, Any, dict[str, Any]]:
    """The segment's status, reason and fix, from its outcome and what the ranks and the disk say; the
    figures are `{"_full": StorageFull}` when the disk or quota is full (`job end` records them)."""
    status = outcome["status"] if outcome else "failed"
    reason = (outcome or {}).get("reason")
    fix = (outcome or {}).get("fix")
    if status == "failed" and (outcome or {}).get("kind") == "config":
        status = "config_error"  # an outcome written before the config_error status existed
    if status in ("failed", "hung") and paths.cancel_requested.exists():
        status, reason = "cancelled", cancelled_by(paths)  # a cancel is nobody's node fault
    elif status == "failed" and (err := config_error(paths, job_id)) is not None:
        # a rank failed on the configuration and took the segment down before rank 0 could say so
        status, fix = "config_error", err.get("fix")
        reason = f"rank {err.get('rank')}: {err.get('reason')}"
    elif status == "failed" and hit_time_limit(ledger, job_id):  # killed at the limit: no node's fault
        status = "timeout"
        reason = "killed at the time limit: the stop save did not finish within the signal lead"
        fix = f"megalaunch resume {paths.root} --set checkpoint.save_time_estimate_s=S (S: the slowest save)"
    elif status == "failed":
        reason = failure_reason(ends[0] if ends else None, reason, exit_code)
    full = None
    if status in ("failed", "storage_full"):  # the disk's figures (and the recipe's schema) only then
        from megalaunch.launcher.accounting.storage import storage_fix, storage_full

        full = storage_full(paths, job_id, outcome)
    if full is not None:  # a full filesystem or quota: not the node's fault, no retry fixes it
        return "storage_full", reason, storage_fix(paths), {"_full": full}
    return status, reason, fix, {}


def hit_time_limit(ledger: Ledger, job_id: str) -> bool:
    return any(e["event"] == "time_limit_reached" and str(e.get("job_id")) == job_id for e in ledger.events())


def advanced(before: int | None, after: int | None) -> bool:
    """Whether the segment left a newer checkpoint than it started from."""
    if after is None:
        return False
    return before is None or after > before


def settle_tracker(paths: RunPaths, job_id: str, log: Echo) -> None:
    """Every rank has exited: the tracker names the whole save it missed, if any (runtime/checkpoint/resume.py)."""
    from megalaunch.runtime.checkpoint.resume import settle_tracker as settle

    try:
        moved = settle(paths, job_id=job_id)
    except OSError as e:  # the next segment's resume does it then
        log(f"could not point the tracker at the newest whole save: {e}")
        return
    if moved is not None:
        log(f"the tracker now names iteration {moved}: a whole save it missed (a rank ended in its last barrier)")


def remove_failed_saves(paths: RunPaths, job_id: str, log: Echo) -> None:
    """Every rank of this segment has exited: a save it left unfinished is garbage (full size, never
    loadable); delete it now rather than leave it to the next segment (a full disk stays full)."""
    from megalaunch.runtime.checkpoint.resume import remove_failed_saves as remove

    try:
        deleted = remove(paths, job_id=job_id)
    except OSError as e:  # clean-up must never change what the chain does
        log(f"could not remove an unfinished save: {e}")
        return
    if deleted:
        log(f"deleted the unfinished save(s) of iteration {', '.join(map(str, deleted))}")


def write_goodput(paths: RunPaths, log: Echo) -> None:
    """Rewrite the chain's goodput (launcher/accounting/goodput.py) with this segment's end."""
    from megalaunch.launcher.accounting.goodput import write_chain_goodput

    try:
        write_chain_goodput(paths)
    except Exception as e:  # accounting must never change what the chain does
        log(f"could not write {paths.goodput}: {e}")
