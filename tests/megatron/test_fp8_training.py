"""`training.precision: fp8` in Megatron's loop, on the CPU (torch._scaled_mm's CPU kernels, fp32 weights; the
GPU's speed and numerics are bench/fp8.py and docs/results.md): the transformer layers' linear layers take FP8
GEMMs and the output layer does not (the ledger says which), the losses stay within FP8's rounding of fp32's,
an fp8 chain resumes exactly, and the checkpoint format is unchanged (an fp32 checkpoint resumes under fp8
rowwise and that one under fp32 again; tensor parallelism's gradient all-reduce goes through the FP8 layers)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from harness import Trainer, last_iteration, ledger, losses, make_run, run_segment

pytestmark = pytest.mark.megatron

ITERS = 12  # room after each stop: the signal lands a few iterations after it is sent on a loaded machine
SETS = (f"training.train_iters={ITERS}", "training.lr_warmup_iters=1", "checkpoint.save_interval=1000")
# FP8 against fp32 on the same data and initialisation: e4m3 keeps 3 mantissa bits (rounding <= 6 %
# per element), which averages out in the GEMMs' sums; over a few steps of the tiny model the loss
# moves by < 1 %. Published FP8 training runs track bf16's loss within ~1 % (docs/results.md, "FP8").
LOSS_RTOL = 0.01


def fp8_settings(paths, recipe: str | None) -> None:
    """The recipe's precision changed between segments: on the CPU, fp8 and fp32 render the same Megatron
    arguments (fp32 weights); only the job's settings say fp8."""
    data = json.loads(paths.runtime_json.read_text())
    data["fp8"] = recipe
    paths.runtime_json.write_text(json.dumps(data))


def test_fp8_trains_close_to_fp32_resumes_exactly_and_shares_the_checkpoint_format(tmp_path: Path) -> None:
    straight = make_run(tmp_path / "a", *SETS, "training.precision=fp8", name="fp8")
    assert json.loads(straight.runtime_json.read_text())["fp8"] == "tensorwise"
    ref_log = tmp_path / "fp8.jsonl"
    t = run_segment(straight, "100", ref_log, None)
    assert t.outcome()["status"] == "finished"
    ref = losses(ref_log)
    [choice] = ledger(straight, "fp8")
    assert (choice["recipe"], choice["path"], choice["fused_casts"]) == ("tensorwise", "torch_scaled_mm", False)
    [layers] = ledger(straight, "fp8_layers")
    assert layers["fp8"] == 2 * 4  # qkv, proj, fc1, fc2 in each of the 2 layers
    assert list(layers["kept"]) == ["output_layer"], layers
    assert "fp8: 8 linear layers take FP8 GEMMs" in t.log()

    # exact resume under fp8: stopped after 3 iterations, resumed to the end
    chain = make_run(tmp_path / "b", *SETS, "training.precision=fp8", name="fp8-chain")
    log = tmp_path / "chain.jsonl"
    assert run_segment(chain, "201", log, stop_after=3).outcome()["status"] == "saved"
    assert run_segment(chain, "202", log, None).outcome()["status"] == "finished"
    assert losses(log) == ref, (losses(log), ref)

    # the checkpoint format is one: fp32 for three iterations, fp8 rowwise for three from that checkpoint, then fp32
    # again from the fp8 segment's checkpoint
    mixed = make_run(tmp_path / "c", *SETS, name="fp32-fp8-fp32")
    mlog = tmp_path / "mixed.jsonl"
    stops = []
    for job, recipe, stop_after in (("301", None, 3), ("302", "rowwise", 3), ("303", None, None)):
        fp8_settings(mixed, recipe)
        out = run_segment(mixed, job, mlog, stop_after=stop_after).outcome()
        assert out["status"] == ("finished" if stop_after is None else "saved"), out
        stops.append(last_iteration(mlog))
        assert [r["recipe"] for r in ledger(mixed, "fp8") if r["job_id"] == job] == ([recipe] if recipe else [])
    assert [r["iteration"] for r in ledger(mixed, "resumed")] == stops[:2]
    mixed_losses = losses(mlog)
    assert sorted(mixed_losses) == sorted(ref) == list(range(1, ITERS + 1))
    for it in ref:  # fp32, fp8 rowwise, fp32: within FP8's rounding of the fp8 reference throughout
        assert mixed_losses[it] == pytest.approx(ref[it], rel=LOSS_RTOL), (it, mixed_losses, ref)
    assert mixed_losses != ref  # different arithmetic: the comparison above is not vacuous
    worst = max(abs(mixed_losses[i] / ref[i] - 1) for i in ref)
    print(f"\n[fp8 CPU] fp32 / fp8 rowwise / fp32 against fp8 tensorwise: max relative loss difference {worst:.2e}")


def test_fp8_under_tensor_parallelism_matches_one_rank(tmp_path: Path) -> None:
    """TP 2 through the FP8 layers' input-gradient all-reduce, then with sequence parallelism through their
    all-gather of the input and reduce-scatter of its gradient (gloo has both): each the model of one rank."""
    sets = (*SETS, "training.precision=fp8", "training.train_iters=3")
    one = make_run(tmp_path / "tp1", *sets, name="fp8-tp1")
    log1 = tmp_path / "tp1.jsonl"
    run_segment(one, "401", log1, None)
    a = losses(log1)
    assert sorted(a) == [1, 2, 3]
    for sp in (False, True):
        two = make_run(tmp_path / f"tp2-{sp}", *sets, "parallel.tensor_model_parallel_size=2",
                       "cluster.tasks_per_node=2", f"parallel.sequence_parallel={str(sp).lower()}", name=f"fp8-tp2-{sp}")
        log2 = tmp_path / f"tp2-{sp}.jsonl"
        t = Trainer(two, world=2, job_id="402", env={"MEGALAUNCH_LOSS_LOG": str(log2), "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        assert t.wait(timeout=600) == [0, 0], t.log()[-3000:]
        assert ledger(two, "fp8_layers")[0]["fp8"] == 8
        assert re.search(rf"^\s*sequence_parallel \.+ {sp}$", t.log(), re.M), "Megatron's argument table"
        b = losses(log2)
        assert sorted(b) == [1, 2, 3]
        for it in a:  # each rank quantizes its own shard: the same model within FP8's rounding
            assert b[it] == pytest.approx(a[it], rel=LOSS_RTOL), (sp, it, a, b)
