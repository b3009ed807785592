"""GPU checks of the training runtime (run on the device machine; skipped without CUDA):

- periodic saves (sync and async) followed by SIGUSR2 to every process of the rank: saved, resumed;
- the tiny recipe in bf16 with the distributed optimizer, local and sdpa attention: stopped twice
  by SIGUSR2, each segment saves at the iteration it stopped and the next resumes exactly there
  with the same consumed samples; losses compared with an uninterrupted run (printed);
- a ~1.2B Llama (Llama 3.2 1B shapes, seq 2048) trains one GPU in bf16 with the distributed
  optimizer, local and sdpa attention; SIGUSR2 -> save -> resume at the same iteration; tokens/s
  and TFLOP/s printed for the notes.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_train_gpu.py -s"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from harness import Trainer, last_iteration, ledger, losses, make_run, wait_for  # noqa: E402

from megalaunch.rundir.files import read_json  # noqa: E402

pytestmark = pytest.mark.gpu

GPU = ("cluster.gpus_per_node=1", "cluster.tasks_per_node=1", "training.precision=bf16",
       "parallel.use_distributed_optimizer=true")
LLAMA_1B = ("model.seq_length=2048", "model.max_position_embeddings=8192", "training.micro_batch_size=2",
            "training.global_batch_size=16", "training.lr_warmup_iters=5", "training.log_interval=1",
            "training.eval_iters=0", "checkpoint.save_interval=100000", "chain.hang_timeout_s=600",
            "cluster.backend=local", "cluster.nodes=1")


def _segments(paths, loss_log: Path, stops: tuple[int | None, ...], job0: int, world: int = 1) -> list[dict]:
    outcomes = []
    for k, stop_after in enumerate(stops):
        start = last_iteration(loss_log)
        t = Trainer(paths, world=world, job_id=str(job0 + k), env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
        if stop_after is not None:
            wait_for(lambda s=start, n=stop_after: last_iteration(loss_log) >= s + n, timeout=600,
                     what=f"{stop_after} iterations", trainer=t)
            t.signal()
        assert t.wait(timeout=900) == [0] * world, t.log()[-4000:]
        outcomes.append(t.outcome())
    return outcomes


@pytest.mark.parametrize("attention", ["local", "sdpa"])
def test_tiny_signal_resume_bf16(tmp_path: Path, attention: str) -> None:
    sets = (*GPU, "training.train_iters=60", "checkpoint.save_interval=1000", f"training.attention={attention}",
            "training.lr_warmup_iters=2")
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "chain.jsonl"
    (ref,) = _segments(make_run(tmp_path / "a", *sets, name="straight"), ref_log, (None,), 100)
    chain = make_run(tmp_path / "b", *sets, name="chain")
    outs = _segments(chain, log, (10, 10, None), 200)
    assert ref["status"] == outs[-1]["status"] == "finished"
    assert [o["status"] for o in outs[:2]] == ["saved", "saved"]
    stops = [o["iteration"] for o in outs[:2]]
    assert [r["iteration"] for r in ledger(chain, "resumed")] == stops
    assert [r["consumed_samples"] for r in ledger(chain, "resumed")] == [2 * s for s in stops]
    a, b = losses(ref_log), losses(log)
    assert sorted(a) == sorted(b) == list(range(1, 61))
    worst = max(abs(a[i] - b[i]) / abs(a[i]) for i in a)
    print(f"\n[tiny bf16 {attention}] stops at {stops}; max relative loss difference vs uninterrupted: {worst:.2e}")
    assert worst < 2e-2  # bf16 kernels need not be bit-reproducible; a restart from scratch is ~10x off


@pytest.mark.parametrize("async_save", [False, True])
def test_periodic_saves_then_group_signal_bf16(tmp_path: Path, async_save: bool) -> None:
    """Periodic saves every 4 iterations (sync, or async with Megatron's persistent writer process),
    then SIGUSR2 to every process of the rank, as Slurm sends it: the writer survives, the segment
    saves at the iteration it stopped, and the next resumes exactly there."""
    sets = (*GPU, "training.train_iters=40", "checkpoint.save_interval=4", "checkpoint.keep_last=50",
            f"checkpoint.async_save={str(async_save).lower()}", "training.attention=sdpa", "training.lr_warmup_iters=2")
    chain = make_run(tmp_path / "c", *sets, name="periodic")
    log = tmp_path / "chain.jsonl"
    outs = _segments(chain, log, (10, 10, None), 400)
    assert [o["status"] for o in outs] == ["saved", "saved", "finished"], outs
    stops = [o["iteration"] for o in outs[:2]]
    assert [r["iteration"] for r in ledger(chain, "resumed")] == stops
    assert [r["consumed_samples"] for r in ledger(chain, "resumed")] == [2 * s for s in stops]
    assert sorted(losses(log)) == list(range(1, 41))
    assert chain.read_tracker() == 40
    print(f"\n[tiny bf16 periodic saves, async={async_save}] stops at {stops}, save times "
          f"{[o['save_times_s'] for o in outs]}")


@pytest.mark.parametrize("attention", ["local", "sdpa"])
def test_llama_1b_trains_and_resumes(tmp_path: Path, attention: str) -> None:
    from megalaunch.config.loader import load_recipe
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    sets = [*GPU, *LLAMA_1B, "training.train_iters=40", f"training.attention={attention}"]
    loaded = load_recipe("train/llama3-1b", sets, name=f"llama1b-{attention}", cluster="local")
    paths = write_run(prepare_run(loaded, root=tmp_path))
    log = tmp_path / "loss.jsonl"
    first, second = _segments(paths, log, (12, None), 300)
    assert first["status"] == "saved" and second["status"] == "finished"
    (resumed,) = ledger(paths, "resumed")
    assert resumed["iteration"] == first["iteration"] and resumed["consumed_samples"] == 16 * first["iteration"]
    lossed = losses(log)
    assert lossed[40] < lossed[1] - 1.0  # it learns (mock data), and did not restart from scratch
    assert lossed[first["iteration"] + 1] < lossed[1] - 0.5
    progress = read_json(paths.progress)
    shutil.rmtree(paths.checkpoints)  # ~17 GB per checkpoint: the machine's disk holds few
    print(f"\n[llama 1.2B {attention}] {torch.cuda.get_device_name()}: {progress['tokens_per_s']:.0f} tokens/s, "
          f"{progress['tflops_per_gpu']:.1f} TFLOP/s; signal save {first['save_times_s']} s; "
          f"loss {lossed[1]:.3f} -> {lossed[40]:.3f}")
