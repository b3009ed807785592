"""Sharded data parallelism (`parallel.data_sharding`, Megatron-FSDP) on the launcher's side: what the job is given
(Megatron's flags, the fsdp_dtensor format, CUDA_DEVICE_MAX_CONNECTIONS, the CPU's gradient scaling), what is
refused before anything is written, the checkpoint completeness check, and the memory model against the
measured llama3-8b (docs/results.md)."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.megatron_args import async_save, checkpoint_format, megatron_args
from megalaunch.config.planner.fit import model_shape, recipe_layout
from megalaunch.config.planner.memory import GIB, estimate
from megalaunch.config.preflight import preflight
from megalaunch.errors import PreflightError
from megalaunch.launcher.prepare.job_inputs import max_connections
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.completeness import incomplete_reason

GPU = ["cluster.gpus_per_node=2", "cluster.tasks_per_node=2", "training.precision=bf16",
       "parallel.use_distributed_optimizer=true"]


def _args(tmp_path: Path, *sets: str) -> list[str]:
    return megatron_args(load_recipe("tiny", list(sets)).recipe, RunPaths(tmp_path / "run"))


@pytest.mark.parametrize(("sharding", "strategy"), [("optimizer_grads", "optim_grads"),
                                                    ("optimizer_grads_params", "optim_grads_params")])
def test_fsdp_renders_megatrons_flags_and_its_checkpoint_format(tmp_path: Path, sharding: str, strategy: str) -> None:
    plain = _args(tmp_path, *GPU)
    got = _args(tmp_path, *GPU, f"parallel.data_sharding={sharding}")
    assert "--use-megatron-fsdp" not in plain and plain[plain.index("--ckpt-format") + 1] == "torch_dist"
    i = got.index("--use-megatron-fsdp")
    assert got[i + 1:i + 3] == ["--data-parallel-sharding-strategy", strategy]
    assert got[got.index("--ckpt-format") + 1] == "fsdp_dtensor" and got.count("--ckpt-format") == 1
    assert "--no-gradient-reduce-div-fusion" not in got  # NCCL has PREMUL_SUM
    recipe = load_recipe("tiny", [*GPU, f"parallel.data_sharding={sharding}"]).recipe
    assert (checkpoint_format(recipe), async_save(recipe), max_connections(recipe)) == ("fsdp_dtensor", False, "8")
    plain_recipe = load_recipe("tiny", GPU).recipe
    assert (checkpoint_format(plain_recipe), async_save(plain_recipe), max_connections(plain_recipe)) == \
        ("torch_dist", True, "1")


def test_fsdp_on_the_cpu_scales_before_a_plain_sum_and_needs_no_distributed_optimizer_flag_in_the_recipe(
        tmp_path: Path) -> None:
    got = _args(tmp_path, "parallel.data_sharding=optimizer_grads_params")  # tiny: 2 CPU ranks, no distributed optimizer
    assert "--distributed-backend" in got and "--no-gradient-reduce-div-fusion" in got
    assert "--use-distributed-optimizer" in got  # Megatron-FSDP's optimizer is the distributed one


@pytest.mark.parametrize(("sets", "field"), [
    (["parallel.pipeline_model_parallel_size=2", "cluster.gpus_per_node=4", "cluster.tasks_per_node=4"],
     "parallel.data_sharding"),
    (["checkpoint.ckpt_format=torch"], "checkpoint.ckpt_format"),
    (["checkpoint.async_save=true"], "checkpoint.async_save"),
])
def test_what_fsdp_cannot_do_is_refused_in_one_line(sets: list[str], field: str) -> None:
    recipe = load_recipe("tiny", [*GPU, "parallel.data_sharding=optimizer_grads_params", *sets]).recipe
    with pytest.raises(PreflightError) as e:
        preflight(recipe)
    assert e.value.field == field and "\n" not in str(e.value)


def _dcp_dir(d: Path, sizes: dict[str, int]) -> None:
    """What Megatron-FSDP leaves on disk, without torch: shard files and a `.metadata` pickle naming their byte
    ranges (with the attributes torch's classes have; as tests/unit/test_resume_from.py's torch_dist), no metadata.json."""
    d.mkdir(parents=True)
    storage = {f"model.module.decoder.layers.{n}.mlp.linear_fc2.weight": SimpleNamespace(relative_path=name, offset=0,
                                                                                       length=size)
               for n, (name, size) in enumerate(sizes.items())}
    for name, size in sizes.items():
        (d / name).write_bytes(b"x" * size)
    (d / ".metadata").write_bytes(pickle.dumps(SimpleNamespace(storage_data=storage)))


def test_an_fsdp_dtensor_checkpoint_is_complete_without_metadata_json(tmp_path: Path) -> None:
    d = tmp_path / "iter_0000004"
    _dcp_dir(d, {"__0_0.distcp": 100, "__1_0.distcp": 80})
    assert incomplete_reason(d) is None and incomplete_reason(d, full=False) is None
    (d / "__1_0.distcp").write_bytes(b"x" * 10)
    assert incomplete_reason(d) == "truncated shard __1_0.distcp (10 < 80 bytes)"
    (d / "__1_0.distcp").unlink()
    assert incomplete_reason(d) == "missing shard __1_0.distcp"
    (d / ".metadata").unlink()
    assert incomplete_reason(d) is not None
    # torch_dist writes metadata.json after its .metadata: one without it (keys not model.module.*) is a cut save
    cut = tmp_path / "iter_0000008"
    cut.mkdir()
    storage = {"decoder.layers.mlp.linear_fc2.weight": SimpleNamespace(relative_path="__0_0.distcp", offset=0, length=8)}
    (cut / "__0_0.distcp").write_bytes(b"x" * 8)
    (cut / ".metadata").write_bytes(pickle.dumps(SimpleNamespace(storage_data=storage)))
    assert incomplete_reason(cut) == "missing metadata.json" and incomplete_reason(cut, full=False) == "missing metadata.json"


def test_the_format_is_told_by_a_key_anywhere_in_the_metadata(tmp_path: Path) -> None:
    """`.metadata` is read in 1 MiB pieces until the key shows: one cut by a piece's end is still found."""
    from megalaunch.runtime.checkpoint.completeness import FSDP_KEY, is_fsdp_dtensor

    for at in (0, (1 << 20) - 5, 3 << 20):
        d = tmp_path / f"at{at}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"\0" * at + FSDP_KEY + b"\0" * 10)
        assert is_fsdp_dtensor(d), at
        (d / "metadata.json").write_text("{}")  # torch_dist's own file: not fsdp_dtensor, whatever the keys
        assert not is_fsdp_dtensor(d), at
    d = tmp_path / "none"
    d.mkdir()
    (d / ".metadata").write_bytes(b"\0" * (2 << 20) + FSDP_KEY[:-1])
    assert not is_fsdp_dtensor(d)


def test_zero3_saves_what_was_measured_on_llama3_8b() -> None:
    """llama3-8b, seq 8192, TP 1 x DP 4, micro-batch 1, GBS 32, bf16 and fp8 on H200s (bench/gpu_session.sh): the
    distributed optimizer peaked at 107.2 GiB, Megatron-FSDP's ZeRO-3 at 73.2 (bf16); fp8 added +8.5 and +8.7."""
    base = ["cluster.nodes=1", "cluster.gpus_per_node=4", "cluster.tasks_per_node=4", "training.global_batch_size=32",
            "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false", "parallel.layout=pinned",
            "training.micro_batch_size=1", "training.recompute=none"]

    def total(*sets: str) -> float:
        r = load_recipe("llama3-8b", [*base, *sets]).recipe
        return estimate(model_shape(r, r.data.vocab_size), recipe_layout(r, 4, 8)).total / GIB

    saved = total() - total("parallel.data_sharding=optimizer_grads_params")
    assert saved == pytest.approx(107.2 - 73.2, abs=2.0)
    fp8 = total("training.precision=fp8", "parallel.data_sharding=optimizer_grads_params") - \
        total("parallel.data_sharding=optimizer_grads_params")
    assert fp8 == pytest.approx(81.9 - 73.2, abs=1.0)
    zero2 = total() - total("parallel.data_sharding=optimizer_grads")
    assert 0 < zero2 < saved  # the gradients alone


def test_the_fsdp_checkpoint_size_is_what_megatron_fsdp_saved() -> None:
    """The tiny recipe on 2 ranks under ZeRO-3 saved 2,317,444 bytes on the CPU (fp32) and 2,322,409 on two H200s
    (bf16): fp32 main weights and Adam's moments, whatever the precision; the torch_dist formula said 1.84 MB."""
    from megalaunch.config.planner.checkpoint_size import recipe_checkpoint_bytes

    for sets, measured in ((["training.global_batch_size=4"], 2_317_444),
                           ([*GPU, "training.attention=sdpa", "training.global_batch_size=8"], 2_322_409)):
        recipe = load_recipe("tiny", [*sets, "parallel.data_sharding=optimizer_grads_params"]).recipe
        assert recipe_checkpoint_bytes(recipe) == pytest.approx(measured, rel=0.01)


def test_a_resume_that_switches_the_checkpoint_format_is_refused(tmp_path: Path) -> None:
    """Megatron loads only the format it saves: a run with torch_dist checkpoints resumed under Megatron-FSDP (or an
    FSDP run resumed without it) is refused before anything is queued, naming the setting."""
    from megalaunch.errors import RunDirError
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.resume_check import check_resumable
    from megalaunch.launcher.prepare.write import write_run

    for saved, now in (("optimizer", "optimizer_grads_params"), ("optimizer_grads_params", "optimizer")):
        root = tmp_path / saved
        paths = write_run(prepare_run(load_recipe("tiny", [f"run.root={root}", f"parallel.data_sharding={saved}"])))
        d = paths.checkpoints / "iter_0000010"
        _dcp_dir(d, {"__0_0.distcp": 8})
        if saved == "optimizer":
            (d / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
        paths.tracker.write_text("10\n")
        same = load_recipe("tiny", [f"run.root={root}", f"parallel.data_sharding={saved}"]).recipe
        check_resumable(paths, same, from_iteration=None, change=None)  # the format it saved: fine
        other = load_recipe("tiny", [f"run.root={root}", f"parallel.data_sharding={now}"]).recipe
        with pytest.raises(RunDirError) as e:
            check_resumable(paths, other, from_iteration=None, change=None)
        assert e.value.field == "parallel.data_sharding" and "cannot load one as the other" in str(e.value)
