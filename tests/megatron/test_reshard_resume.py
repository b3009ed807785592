"""A chain that shrinks and grows its data-parallel size (cluster.min_nodes, issue 33) stays exact: the
tiny recipe (global batch 12, micro-batch 1, the distributed optimizer) trains on 3 ranks, is stopped by
SIGUSR2, resumes on 2 ranks (DP 2: 6 micro-batches per rank instead of 4, as Megatron's own
arguments table in the log says), is stopped again and ends on
3 ranks. Every iteration's loss equals an uninterrupted 3-rank run's (CPU fp32, relative difference
<= 1e-5: only the order of the sums differs) and the consumed samples continue exactly; Megatron's
torch_dist checkpoint (the distributed optimizer's dp_reshardable state) reshards to each DP size.
The Slurm side of shrinking (a node lost, the smaller step, the next segment on all nodes):
tests/slurm/test_scale_slurm.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from harness import Trainer, last_iteration, ledger, losses, make_run, wait_for

pytestmark = pytest.mark.megatron

ITERS = 12
GBS = 12
SETS = (f"training.train_iters={ITERS}", "training.micro_batch_size=1", f"training.global_batch_size={GBS}",
        "checkpoint.save_interval=100", "checkpoint.keep_last=50", "training.lr_warmup_iters=2",
        "parallel.use_distributed_optimizer=true")


def _segment(paths, job_id: str, world: int, loss_log: Path, stop_after: int | None) -> dict:
    """One segment on `world` ranks; its outcome, after checking Megatron ran it with DP = `world`."""
    start = last_iteration(loss_log)
    t = Trainer(paths, world=world, job_id=job_id, env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    if stop_after is not None:
        wait_for(lambda: last_iteration(loss_log) >= start + stop_after, what=f"{stop_after} iterations", trainer=t)
        t.signal()
    assert t.wait() == [0] * world, t.log()[-3000:]
    dp = re.search(r"^\s*data_parallel_size \.+ (\d+)$", t.log(), re.M)  # Megatron's own arguments table
    assert dp is not None and int(dp.group(1)) == world, t.log()[:3000]
    return t.outcome()


def test_a_chain_that_changes_its_data_parallel_size_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = make_run(tmp_path / "a", *SETS, name="straight")
    ref_log = tmp_path / "straight.jsonl"
    assert _segment(straight, "100", 3, ref_log, None)["status"] == "finished"

    chain = make_run(tmp_path / "b", *SETS, name="chain")
    log = tmp_path / "chain.jsonl"
    stops = []
    for job, world, stop_after in (("201", 3, 3), ("202", 2, 3), ("203", 3, None)):
        out = _segment(chain, job, world, log, stop_after)
        assert out["status"] == ("finished" if stop_after is None else "saved"), out
        if stop_after is not None:
            stops.append(out["iteration"])
    resumed = [(r["job_id"], r["iteration"], r["consumed_samples"]) for r in ledger(chain, "resumed")]
    assert resumed == [("202", stops[0], GBS * stops[0]), ("203", stops[1], GBS * stops[1])], resumed

    ref, got = losses(ref_log), losses(log)
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1))
    worst = max(abs(got[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= 1e-5, {i: (ref[i], got[i]) for i in ref if not math.isclose(ref[i], got[i], rel_tol=1e-5)}
