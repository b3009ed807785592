"""Resume of the tiny MoE (recipe tiny-moe: 8 experts, top-2, alltoall dispatcher) with expert parallelism 2 on
two CPU ranks (gloo) is exact: a chain stopped by SIGUSR2 and resumed gives every iteration the loss of an
uninterrupted run (CPU fp32, relative difference <= 1e-6), and at the end the same weights and the same
optimizer state, the experts' included: their parameters live in the distributed optimizer's expert-parallel
buffer (a second optimizer, Megatron's ChainedOptimizer), whose Adam moments and `step` must survive the
resume as the dense parameters' do (runtime/loop/megatron_patches.fix_optimizer_step).

A resume that changes EP (`megalaunch resume RUN --set parallel.expert_model_parallel_size=1`) is refused before
anything is written, in one line naming the field: Megatron 0.19 cannot load an MoE checkpoint into another
expert layout (EP 2 -> 1 on two ranks failed in the job with the distributed optimizer, a missing `chained_N`
key, and without it, "Could not find parameter group"; launcher/prepare/resume_check.py)"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import SRC, Trainer, checkpoint_state, last_iteration, ledger, losses, make_run, wait_for

from megalaunch.runtime.checkpoint.resume import iter_dir

pytestmark = pytest.mark.megatron

ITERS = 8
SETS = (f"training.train_iters={ITERS}", "training.global_batch_size=4", "training.lr_warmup_iters=2",
        "checkpoint.save_interval=100", "checkpoint.keep_last=50", "parallel.use_distributed_optimizer=true",
        "cluster.tasks_per_node=2", "parallel.expert_model_parallel_size=2")


def _segment(paths, job_id: str, loss_log: Path, stop_after: int | None) -> dict:
    """One segment on two ranks; with `stop_after`, SIGUSR2 once it has trained that many iterations."""
    start = last_iteration(loss_log)
    t = Trainer(paths, world=2, job_id=job_id, env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    if stop_after is not None:
        wait_for(lambda: last_iteration(loss_log) >= start + stop_after, what=f"{stop_after} iterations", trainer=t)
        t.signal()
    assert t.wait() == [0, 0], t.log()[-3000:] + t.log(1)[-3000:]
    return t.outcome()


def _straight(tmp: Path) -> tuple[Path, dict[int, float]]:
    """The uninterrupted EP 2 run: its run directory and its losses."""
    paths = make_run(tmp / "run", *SETS, name="straight", recipe="tiny-moe")
    log = tmp / "straight.jsonl"
    assert _segment(paths, "100", log, None)["status"] == "finished"
    return paths, losses(log)


def _assert_same_losses(ref: dict[int, float], got: dict[int, float], rel: float) -> None:
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1))
    worst = max(abs(got[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= rel, {i: (ref[i], got[i]) for i in ref if not math.isclose(ref[i], got[i], rel_tol=rel)}


def _optimizer_steps(directory: Path) -> list[tuple[bool, float]]:
    """(expert-parallel?, step) of every param group of the distributed optimizers in a torch_dist checkpoint
    (an MoE model has two, chained: the dense parameters' and the experts')."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ckpt.pt"
        dcp_to_torch_save(str(directory), str(out))
        sd = torch.load(out, weights_only=False)
    return sorted((bool(g["is_expert_parallel"]), float(g["step"])) for k, v in sd.items()
                  if ".optimizer.distributed." in k and k.endswith(".optimizer/shard_0_1") for g in v[0]["param_groups"])


def _refused_ep_change(chain) -> None:
    """`megalaunch resume RUN --set parallel.expert_model_parallel_size=1`: one line, nothing changed."""
    before = {p: p.read_bytes() for p in (chain.run_yaml, chain.megatron_args, chain.manifest, chain.ledger)}
    proc = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "resume", str(chain.root), "--set",
                           "parallel.expert_model_parallel_size=1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(SRC)}, stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr + proc.stdout
    assert "parallel.expert_model_parallel_size" in lines[0] and "EP 2" in lines[0], lines[0]
    assert {p: p.read_bytes() for p in before} == before  # nothing written, no segment started


def test_ep2_signal_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    ref_paths, ref = _straight(tmp_path / "a")
    chain = make_run(tmp_path / "b", *SETS, name="chain", recipe="tiny-moe")
    log = tmp_path / "chain.jsonl"
    first = _segment(chain, "201", log, 3)
    assert first["status"] == "saved" and chain.read_tracker() == first["iteration"] < ITERS, first
    _refused_ep_change(chain)
    assert _segment(chain, "202", log, None)["status"] == "finished"
    assert [(r["job_id"], r["iteration"]) for r in ledger(chain, "resumed")] == [("202", first["iteration"])]
    _assert_same_losses(ref, losses(log), 1e-6)

    a, b = checkpoint_state(iter_dir(ref_paths, ITERS)), checkpoint_state(iter_dir(chain, ITERS))
    assert a.keys() == b.keys()
    # chained_1: the expert-parallel optimizer's flat buffers (params, Adam moments) of both EP ranks
    experts = [k for k in a if k.startswith("chained_1.optimizer.") and k.endswith((".exp_avg", ".exp_avg_sq"))]
    assert len(experts) == 4, sorted(a)
    compared = 0
    for key in a:
        if key.startswith(("chained_", "embedding", "decoder", "output_layer")):
            compared += 1
            assert (a[key] - b[key]).abs().max().item() <= 1e-6 * max(1.0, a[key].abs().max().item()), key
    assert compared > len(experts) + 10 and any(".experts." in k for k in a)  # weights (experts'), Adam moments
    # Adam's step of the dense and of the expert optimizer survived the resume (Megatron 0.19 resets it)
    steps = _optimizer_steps(iter_dir(chain, ITERS))
    assert {e for e, _ in steps} == {False, True} and {s for _, s in steps} == {float(ITERS)}, steps
    assert _optimizer_steps(iter_dir(ref_paths, ITERS)) == steps


def test_ep2_x_tp2_with_sequence_parallelism_trains_as_ep2(tmp_path: Path) -> None:
    """EP 2 x TP 2 on four ranks (expert TP 2: the dispatcher's unequal gathers and reduce-scatters over the
    expert-TP group, runtime/model/moe_cpu.py; the sequence-parallel torch norm) computes what EP 2 x DP 2
    does: the same losses as EP 2 on two ranks (same data, global batch 4, DP 2), to the order of the sums."""
    runs = {}
    for name, world, extra in (("ep2", 2, ()), ("ep2tp2", 4, ("cluster.tasks_per_node=4",
                               "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"))):
        paths = make_run(tmp_path / name, *SETS[:-2], "parallel.expert_model_parallel_size=2",
                         *(extra or ("cluster.tasks_per_node=2",)), "training.train_iters=4", name=name,
                         recipe="tiny-moe")
        log = tmp_path / f"{name}.jsonl"
        t = Trainer(paths, world=world, env={"MEGALAUNCH_LOSS_LOG": str(log), "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        assert t.wait() == [0] * world, t.log()[-3000:]
        runs[name] = losses(log)
    assert sorted(runs["ep2"]) == sorted(runs["ep2tp2"]) == [1, 2, 3, 4]
    for i, ref in runs["ep2"].items():
        assert math.isclose(runs["ep2tp2"][i], ref, rel_tol=1e-5), runs
