"""config/planner/checkpoint_size.py against real saves: the tiny recipe trained on the CPU by Megatron's loop
and saved in torch_dist, every file of the checkpoint counted (within 5 %; measured within 0.1 %),
with and without the distributed optimizer, on 1 and 2 ranks. Its model state against Megatron's own
theoretical memory (weights + gradients + optimizer, less the fp32 gradients a checkpoint does not
hold). And torch's own error when a save fills a real (tmpfs) filesystem is classified as storage."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import FAST, Trainer, make_run
from test_memory_model import megatron_weight_and_optimizer_bytes

from megalaunch.config.loader import load_recipe
from megalaunch.config.planner.checkpoint_size import recipe_peak
from megalaunch.config.planner.fit import model_shape, recipe_layout
from megalaunch.config.topology import topology
from megalaunch.launcher.accounting.storage import checkpoint_usage
from megalaunch.runtime.checkpoint.resume import iter_dir
from megalaunch.runtime.rank.failures import classify
from megalaunch.runtime.rank.storage import storage_evidence

pytestmark = pytest.mark.megatron


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@pytest.mark.parametrize(("dist", "world"), [(False, 1), (True, 2)])
def test_predicted_bytes_match_a_real_save(tmp_path: Path, dist: bool, world: int) -> None:
    sets = ["training.train_iters=2", "checkpoint.save_interval=2", "training.lr_warmup_iters=1",
            f"parallel.use_distributed_optimizer={str(dist).lower()}", f"cluster.tasks_per_node={world}",
            f"training.global_batch_size={2 * world}"]
    paths = make_run(tmp_path, *sets)
    t = Trainer(paths, world=world, job_id="1")
    assert t.wait() == [0] * world, t.log()[-3000:]
    assert t.outcome()["status"] == "finished"
    actual = _bytes(iter_dir(paths, 2))
    recipe = load_recipe("tiny", [*FAST, *sets]).recipe
    predicted = recipe_peak(recipe, recipe.data.vocab_size).checkpoint
    assert predicted.total == pytest.approx(actual, rel=0.05)
    assert predicted.total == pytest.approx(actual, rel=0.005), (predicted.total, actual)  # what was measured
    usage = checkpoint_usage(paths)  # what `status` shows: du of checkpoints/ and the count
    assert usage["count"] == 1 and usage["bytes"] >= actual * 0.99
    assert usage["predicted_bytes"] == pytest.approx(predicted.total)


@pytest.mark.parametrize("ref", ["llama3-1b", "llama3-8b", "gpt-345m"])
def test_checkpoint_state_is_megatrons_model_state_without_the_gradients(ref: str) -> None:
    """Non-distributed optimizer, one GPU: Megatron counts 18 bytes per parameter (bf16 weights 2, fp32
    gradients 4, fp32 main parameters and two moments 12); a checkpoint holds all but the gradients."""
    recipe = load_recipe(ref, ["cluster.nodes=1", "cluster.gpus_per_node=1", "parallel.tensor_model_parallel_size=1",
                               "parallel.pipeline_model_parallel_size=1",
                               "parallel.virtual_pipeline_model_parallel_size=null",
                               "parallel.sequence_parallel=false", "parallel.use_distributed_optimizer=false",
                               "training.global_batch_size=8", "training.micro_batch_size=1"]).recipe
    vocab = recipe.data.vocab_size or 50257
    topo = topology(recipe)
    shape = model_shape(recipe, vocab)
    theirs = megatron_weight_and_optimizer_bytes(shape, recipe_layout(recipe, topo.dp, topo.num_microbatches))
    size = recipe_peak(recipe, vocab).checkpoint
    assert size.weights + size.main_params + size.moments == pytest.approx(theirs - 4 * size.params, rel=0.001)


def test_a_torch_save_that_fills_a_real_filesystem_is_storage(tmp_path: Path) -> None:
    import torch
    from tests.support.tmpfs import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "fs", "4m") as fs:
        try:
            torch.save(torch.zeros(4 << 20), fs / "model.pt")  # 16 MB into 4 MiB
        except Exception as e:  # torch's truncated write, however this version words it
            error: BaseException = e
        else:
            raise AssertionError("torch.save fitted 16 MB into 4 MiB")
    f = classify(error, started=True)
    assert f.storage and not f.config, f"{type(error).__name__}: {error}"
    assert storage_evidence(f.reason)
