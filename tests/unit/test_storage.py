"""Issue 23, login side: the checkpoint size (against hand arithmetic and the measured saves), the peak
that retention implies, storage failures told apart from node faults (real error strings, a real
ENOSPC), and the disk budget at submit against a real small filesystem (a tmpfs holding the run root)."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pytest
from tests.support.tmpfs import fill, mounted_tmpfs
from tests.unit.helpers import cli
from tests.unit.test_chain import RecordingScheduler, _outcome
from tests.unit.test_nodes import events, task

from megalaunch.config.loader import load_recipe
from megalaunch.config.planner.checkpoint_size import checkpoint_size, disk_peak, peak_counts, recipe_peak
from megalaunch.config.planner.fit import model_shape
from megalaunch.config.storage import DiskBudget, check_disk, parse_lfs_df, parse_lfs_quota, parse_quota
from megalaunch.errors import PreflightError
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.prepare.prepare import prepare_run, prepare_submission
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.status import run_status
from megalaunch.launcher.status_format import format_run_status
from megalaunch.runtime.rank.failures import STORAGE_PREFIX, classify
from megalaunch.runtime.rank.storage import (
    STORAGE_FIX,
    Filesystem,
    describe,
    filesystem_of,
    fits,
    free_bytes,
    storage_error,
    storage_evidence,
)

MB = 1e6


@pytest.fixture()
def fs(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "fs", "64m") as d:
        yield d


# --- the size of one checkpoint ----------------------------------------------------------------------

def test_tiny_parameter_count_by_hand() -> None:
    shape = model_shape(load_recipe("tiny").recipe, 512)
    # per layer: QKV 64 x (64 + 2 x 32), proj 64 x 64, SwiGLU 3 x 64 x 128, two norms; embedding and output
    # layer 512 x 64 each (untied); the final norm
    by_hand = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 2 * 512 * 64 + 64
    assert shape.total_params() == by_hand == 139_584


def test_llama3_1b_is_14_bytes_per_parameter_and_matches_the_measured_16_gib() -> None:
    size = recipe_peak(load_recipe("llama3-1b").recipe, 128256).checkpoint
    layer = 2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048
    params = 16 * layer + 128256 * 2048 + 2048  # tied embeddings: one copy
    assert size.params == params == 1_235_814_400
    assert size.weights + size.main_params + size.moments == 14 * params  # bf16 2 + fp32 main 4 + Adam 8
    assert size.overhead < 2 * MB
    assert size.total / 2**30 == pytest.approx(16.1, abs=0.05)  # FACTS.md: "~16 GB" on one H200 (du, GiB)
    assert "17.3 GB (1.24 B parameters x 14 bytes" in size.describe()


@pytest.mark.parametrize(("precision", "dist", "sgd", "per_param"), [
    ("bf16", True, False, 14), ("bf16", False, False, 14), ("fp16", True, False, 14),
    ("fp32", False, False, 12),  # no master copy: weights 4 + moments 8
    ("fp32", True, False, 16),  # the distributed optimizer saves its fp32 `param` shards too (measured)
    ("bf16", True, True, 10),  # SGD: one momentum
])
def test_bytes_per_parameter(precision: str, dist: bool, sgd: bool, per_param: int) -> None:
    sets = [f"training.precision={precision}", f"parallel.use_distributed_optimizer={str(dist).lower()}"]
    if sgd:
        sets.append("megatron_args.optimizer=sgd")
    size = recipe_peak(load_recipe("llama3-8b", sets).recipe, 128256).checkpoint
    assert (size.weights + size.main_params + size.moments) / size.params == per_param


# Every file of four real saves of the tiny recipe (2 iterations, torch 2.14, megatron-core 0.19.2,
# measured again by tests/megatron/test_checkpoint_size.py): bytes of iter_0000002 by (distributed
# optimizer, ranks).
MEASURED_TINY = {(False, 1): 1_835_336, (True, 1): 2_416_057, (True, 2): 2_419_144, (False, 2): 1_839_668}


@pytest.mark.parametrize(("dist", "world"), sorted(MEASURED_TINY))
def test_tiny_prediction_matches_the_measured_saves(dist: bool, world: int) -> None:
    shape = model_shape(load_recipe("tiny").recipe, 512)
    size = checkpoint_size(shape, precision="fp32", distributed_optimizer=dist, world=world)
    assert size.total == pytest.approx(MEASURED_TINY[(dist, world)], rel=0.005)
    # the fixed costs are ~9 % of a tiny checkpoint: without them the prediction would miss by that much
    assert size.overhead / size.total > 0.06


# --- the peak on disk ----------------------------------------------------------------------------------

def _simulate(train_iters: int, save_interval: int, keep_last: int, milestone_interval: int) -> tuple[int, int]:
    """runtime/retention.keep's rule, save by save: the most checkpoints at once (+ the one being written)."""
    from megalaunch.runtime.checkpoint.retention import keep

    complete: list[int] = []
    peak = 0
    for it in [*range(save_interval, train_iters, save_interval), train_iters]:
        peak = max(peak, len(complete) + 1)  # writing `it`
        complete.append(it)
        doomed = keep(complete, complete, keep_last=keep_last, milestone_interval=milestone_interval).doomed
        complete = [i for i in complete if i not in doomed]
    return peak, 0


@pytest.mark.parametrize(("train_iters", "save", "keep", "milestone"), [
    (1000, 25, 2, 0), (1000, 25, 2, 100), (1000, 25, 2, 50), (1000, 25, 0, 0), (50, 25, 5, 0), (1000, 30, 3, 100),
    (200, 1, 40, 0), (997, 10, 1, 70),
])
def test_peak_counts_follow_the_retention_rule(train_iters: int, save: int, keep: int, milestone: int) -> None:
    regular, milestones = peak_counts(train_iters=train_iters, save_interval=save, keep_last=keep,
                                      milestone_interval=milestone)
    assert regular + milestones == _simulate(train_iters, save, keep, milestone)[0]


def test_peak_counts_by_hand() -> None:
    assert peak_counts(train_iters=1000, save_interval=25, keep_last=2, milestone_interval=0) == (3, 0)
    # milestones 100..900 are kept forever; 975 and 950 are the regular ones; 1000 is being written
    assert peak_counts(train_iters=1000, save_interval=25, keep_last=2, milestone_interval=100) == (3, 9)
    assert peak_counts(train_iters=1000, save_interval=25, keep_last=0, milestone_interval=0) == (40, 0)


def test_evaluation_adds_a_waiting_checkpoint_and_a_hugging_face_copy() -> None:
    shape = model_shape(load_recipe("llama3-1b").recipe, 128256)
    size = checkpoint_size(shape, precision="bf16", distributed_optimizer=True)
    kw = {"train_iters": 1000, "save_interval": 25, "keep_last": 2}
    on_milestones = disk_peak(size, shape, milestone_interval=100, eval_interval=100, **kw)
    assert (on_milestones.eval_waiting, on_milestones.hf_copies) == (0, 1)  # a milestone is kept anyway
    assert on_milestones.hf_bytes == pytest.approx(2 * (1_235_814_400 - 0), rel=1e-3)  # bf16, real vocabulary
    between = disk_peak(size, shape, milestone_interval=0, eval_interval=50, **kw)
    assert (between.eval_waiting, between.hf_copies) == (1, 1)
    kept = disk_peak(size, shape, milestone_interval=0, eval_interval=50, keep_hf=True, **kw)
    assert kept.hf_copies == 20
    assert kept.total == pytest.approx(4 * size.total + 20 * kept.hf_bytes)
    assert "1 waiting for its evaluation + 20 Hugging Face copies" in kept.describe()


# --- storage failures ----------------------------------------------------------------------------------

STORAGE_TEXTS = [
    "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598",  # FACTS.md
    "CheckpointException ranks:dict_keys([0]) Worker failure: An error is caught while starting worker 0",
    "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([0])\n"
    "Traceback (most recent call last): (RANK 0)\n  File \"filesystem_async.py\", line 312\n"
    "Worker failure: An error is caught while starting worker 0",
    "RuntimeError: PytorchStreamWriter failed writing file data/3: file write failed",
    "OSError: [Errno 28] No space left on device: '/scratch/run/checkpoints/iter_0000050/__0_0.distcp'",
    "OSError: [Errno 122] Disk quota exceeded",
    "write error: ENOSPC",
]
OTHER_TEXTS = [
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "CheckpointException ranks:dict_keys([1]) Worker failure: RuntimeError: CUDA error: an illegal memory access",
    "FileNotFoundError: [Errno 2] No such file or directory: '/data/x.bin'",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory",
    "OSError: [Errno 5] Input/output error",
]


@pytest.mark.parametrize("text", STORAGE_TEXTS)
def test_storage_texts_are_storage(text: str) -> None:
    assert storage_evidence(text)
    f = classify(RuntimeError(text), started=True)
    assert f.storage and not f.config and f.reason.startswith(STORAGE_PREFIX) and f.fix == STORAGE_FIX
    assert not classify(RuntimeError(text), started=False).config  # before the first step too: not a config error


@pytest.mark.parametrize("text", OTHER_TEXTS)
def test_other_failures_are_not_storage(text: str) -> None:
    assert storage_evidence(text) is None
    assert not classify(RuntimeError(text), started=True).storage


def test_a_real_enospc_from_a_full_filesystem_is_storage_through_the_exception_chain(fs: Path) -> None:
    try:
        try:
            with open(fs / "big.bin", "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))
        except OSError as e:
            assert e.errno == errno.ENOSPC
            raise RuntimeError("checkpoint save failed") from e  # a wrapper that says nothing about space
    except RuntimeError as wrapped:
        assert storage_error(wrapped) == "[Errno 28] No space left on device"
        f = classify(wrapped, started=True)
    assert f.storage and not f.config and storage_evidence(f.reason)


def test_free_space_helpers_on_a_real_filesystem(fs: Path) -> None:
    target = fs / "runs" / "not-yet" / "checkpoints"  # need not exist
    assert filesystem_of(target) == Filesystem(str(fs), "tmpfs", "tmpfs")
    assert free_bytes(target) == 64 * 2**20
    assert fits(target, 60 * MB) and not fits(target, 66 * MB) and not fits(target, 64 * MB, margin=0.1)
    fill(fs, 10 * 2**20)
    assert free_bytes(target) <= 10 * 2**20 and not fits(target, 20 * MB)
    text = describe(target, 20 * MB)
    assert text.startswith(f"filesystem tmpfs ({fs}, tmpfs), 0.01 GB free, 0.02 GB needed; fix: ")


# --- quotas (the tools' own output formats) ------------------------------------------------------------

LFS_QUOTA = """Disk quotas for usr bob (uid 6000):
     Filesystem  kbytes   quota   limit   grace   files   quota   limit   grace
/capstor/scratch/cscs
                 30000*  30000  31000  6d23h59m50s     1       0       0       -
"""
QUOTA_W = """Disk quotas for user alice (uid 1000):
     Filesystem  blocks   quota   limit   grace   files   quota   limit   grace
      /dev/sdb1  400000  500000  600000            1200       0       0
"""
LFS_DF = """UUID                   1K-blocks        Used   Available Use% Mounted on
testfs-MDT0000_UUID      1048576       5372     1043204   1% /mnt/testfs[MDT:0]
testfs-OST0000_UUID    104857600  104000000      857600  99% /mnt/testfs[OST:0]
testfs-OST0001_UUID    104857600   10000000    94857600  10% /mnt/testfs[OST:1]

filesystem_summary:    209715200  114000000    95715200  54% /mnt/testfs
"""


def test_quota_outputs_are_read() -> None:
    q = parse_lfs_quota(LFS_QUOTA, "/capstor/scratch/cscs")
    assert q is not None and (q.used, q.limit, q.left) == (30000 * 1024, 31000 * 1024, 1000 * 1024)
    assert parse_lfs_quota(LFS_QUOTA, "/other") is None
    q = parse_quota(QUOTA_W, Filesystem("/home", "/dev/sdb1", "ext4"))
    assert q is not None and q.left == 200000 * 1024
    assert parse_quota("Disk quotas for user alice (uid 1000): none\n", Filesystem("/", "/dev/sda", "ext4")) is None
    assert parse_lfs_df(LFS_DF) == 857600 * 1024


def test_a_quota_tighter_than_the_free_space_refuses(fs: Path) -> None:
    recipe = load_recipe("tiny", [f"run.root={fs}/runs"]).recipe
    peak = recipe_peak(recipe, 512)
    text = LFS_QUOTA.replace("/capstor/scratch/cscs", str(fs)).replace("31000", "34000")  # 4,000 KiB left
    q = parse_lfs_quota(text, str(fs))
    assert q is not None and q.left < peak.total < free_bytes(fs)
    budget = DiskBudget(peak=peak, directory=str(fs), filesystem=filesystem_of(fs), free=free_bytes(fs), quota=q)
    assert not budget.fits and budget.available == q.left
    with pytest.raises(PreflightError, match=r"quota 0\.0041 GB left \(lfs quota .*fix: --set checkpoint\.keep_last=1"):
        check_disk(recipe, budget, 512)


# --- the budget at submit, on a real 64 MiB filesystem --------------------------------------------------

BIG = ["checkpoint.save_interval=1", "checkpoint.keep_last=40"]  # 41 x 1.84 MB = 75 MB > 64 MiB


def test_a_peak_larger_than_the_filesystem_is_refused_and_nothing_is_written(fs: Path) -> None:
    with pytest.raises(PreflightError) as e:
        prepare_submission("tiny", [f"run.root={fs}/runs", *BIG])
    text = str(e.value)
    assert "\n" not in text and e.value.field == "checkpoint.keep_last"
    assert "41 checkpoints (keep_last 40 + 1 being written)" in text and "0.075 GB" in text
    assert f"filesystem tmpfs ({fs}, tmpfs): 0.067 GB free" in text
    keep = int(text.split("fix: --set checkpoint.keep_last=")[1].split(" ")[0])
    assert 30 <= keep < 40  # the largest that fits: (keep + 1) x 1.84 MB <= 67 MB
    assert "--set run.root=DIR" in text and "checkpoint.disk_check=false" in text
    assert list(fs.iterdir()) == []
    # the fix offered passes, and the escape hatch is explicit
    assert prepare_submission("tiny", [f"run.root={fs}/runs", *BIG, f"checkpoint.keep_last={keep}"]).budget.fits
    assert not prepare_submission("tiny", [f"run.root={fs}/runs", *BIG, "checkpoint.disk_check=false"]).budget.fits


def test_a_peak_that_fits_passes_and_the_run_is_written(fs: Path) -> None:
    prepared = prepare_submission("tiny", [f"run.root={fs}/runs", "checkpoint.save_interval=1",
                                           "checkpoint.keep_last=20"])
    assert prepared.budget is not None and prepared.budget.fits
    assert prepared.budget.peak.regular == 21 and prepared.budget.filesystem.mount == str(fs)
    paths = write_run(prepared)
    assert paths.checkpoints.is_dir()


def test_a_filesystem_filled_from_outside_refuses_even_the_shipped_retention(fs: Path) -> None:
    fill(fs, 4 * 2**20)  # 4 MiB left: 3 x 1.84 MB does not fit, 2 x does
    with pytest.raises(PreflightError, match=r"fix: --set checkpoint\.keep_last=1 \(peak 0\.0037 GB\)"):
        prepare_submission("tiny", [f"run.root={fs}/runs"])
    assert sorted(p.name for p in fs.iterdir()) == ["filler.bin"]


def test_cli_dry_run_shows_the_figures_and_submit_refuses_in_one_line(fs: Path) -> None:
    root = f"run.root={fs}/runs"
    ok = cli("submit", "tiny", "--set", root, "--dry-run")
    assert ok.returncode == 0, ok.stderr
    assert "checkpoint: 0.0018 GB (0.14 M parameters x 12 bytes: fp32 weights 4 + optimizer moments 8;" in ok.stdout
    assert "disk peak: 0.0055 GB: 3 checkpoints (keep_last 2 + 1 being written)" in ok.stdout
    assert f"disk: filesystem tmpfs ({fs}, tmpfs): 0.067 GB free: fits" in ok.stdout
    big = [a for s in [root, *BIG] for a in ("--set", s)]
    dry = cli("submit", "tiny", *big, "--dry-run")
    assert dry.returncode == 0 and "DOES NOT FIT" in dry.stdout and "disk: submit refuses this: " in dry.stdout
    refused = cli("submit", "tiny", *big)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith(
        "megalaunch: error: checkpoint.keep_last: the checkpoints need up to 0.075 GB")
    assert list(fs.iterdir()) == []


# --- job end: storage_full -----------------------------------------------------------------------------

def _fill_with_a_save(directory: Path) -> OSError:
    """A save that fills the disk: a shard file written until the filesystem refuses (a real ENOSPC)."""
    directory.mkdir(parents=True)
    try:
        with open(directory / "__0_0.distcp", "wb") as f:
            while True:
                f.write(b"\0" * (1 << 20))
    except OSError as e:
        assert e.errno == errno.ENOSPC
        return e
    raise AssertionError("the filesystem never filled")


def test_a_save_that_fills_the_disk_ends_the_chain_without_blaming_the_node(fs: Path, monkeypatch) -> None:
    """The run directory on the filesystem the save filled: the trainer cannot even write its outcome
    (measured here: ENOSPC on state/outcome.json), yet the chain stops with the figures and the fix."""
    paths = write_run(prepare_run(load_recipe("tiny", [f"run.root={fs}/runs", "training.train_iters=100",
                                                       "chain.max_segments_without_progress=3"])))
    sched = RecordingScheduler()
    chain = Chain(paths, sched)
    assert chain.begin("7").proceed and sched.submitted == ["100"]
    unfinished = paths.checkpoints / "iter_0000050"
    _fill_with_a_save(unfinished)
    with pytest.raises(OSError) as e:  # the trainer's own record fails on the full filesystem
        _outcome(monkeypatch, paths, "7", "failed", reason="whatever", iteration=49)
    assert e.value.errno == errno.ENOSPC
    task(paths, "7", 0, "vm", "raise SystemExit(1)")  # its supervisor's record fails too; the rank exits 1
    verdict = chain.end("7", 1)
    assert not verdict.proceed and verdict.reason.startswith("storage full, no retry can fix it: filesystem tmpfs")
    assert events(paths, "node_suspected") == [] and sched.excluded == {}  # the node is not to blame
    assert sched.cancelled == ["100"] and events(paths, "guard") == []  # stopped at once, no budget spent
    (ended,) = events(paths, "ended")
    assert ended["outcome"] == "storage_full" and ended["fix"].startswith("free space on the checkpoint filesystem")
    s = ended["storage"]
    assert s["mount"] == str(fs) and s["fstype"] == "tmpfs" and s["free_bytes"] < 1 * MB
    assert s["free_after_cleanup_bytes"] > 60 * MB  # the unfinished save is gone
    assert s["need_bytes"] == pytest.approx(1_835_336, rel=0.005)
    assert "less than one checkpoint needs (0.0018 GB)" in s["evidence"]
    assert not unfinished.exists()
    (stopped,) = events(paths, "chain_stopped")
    assert "0.0018 GB" in stopped["reason"] and f"megalaunch resume {paths.root}" in stopped["fix"]
    text = format_run_status(run_status(paths))
    assert "chain: stopped - storage full" in text and "STORAGE_FULL" in text
    assert "  checkpoints: 0 on disk, 0 GB (du); predicted 0.0018 GB each, peak 0.0037 GB: 2 checkpoints" in text
    assert f"  disk: filesystem tmpfs ({fs}, tmpfs): 0.067 GB free" in text


def test_the_trainers_reason_names_the_storage_failure(fs: Path, tmp_path: Path, monkeypatch) -> None:
    """The trainer's reason (runtime/failures.classify of a real ENOSPC) is enough; the node is not blamed
    although its rank exited non-zero."""
    paths = write_run(prepare_run(load_recipe("tiny", [f"run.root={tmp_path}/runs", "training.train_iters=100"])))
    chain = Chain(paths, RecordingScheduler())
    chain.begin("9")
    assert not classify(RuntimeError("checkpoint save failed"), started=True).storage
    try:
        raise RuntimeError("checkpoint save failed") from _fill_with_a_save(fs / "ckpt")
    except RuntimeError as err:
        reason = classify(err, started=True).reason
    task(paths, "9", 0, "vm", "raise SystemExit(1)")
    _outcome(monkeypatch, paths, "9", "failed", reason=reason, iteration=49)
    assert not chain.end("9", 1).proceed
    (ended,) = events(paths, "ended")
    assert ended["outcome"] == "storage_full" and "[Errno 28] No space left on device" in ended["storage"]["evidence"]
    assert events(paths, "node_suspected") == []


def test_the_truncated_write_in_the_log_is_enough(tmp_path: Path, monkeypatch) -> None:
    """A trainer that did not recognise it (its reason names only Megatron's wrapper): the segment's log
    holds torch's truncated write."""
    paths = write_run(prepare_run(load_recipe("tiny", [f"run.root={tmp_path}", "training.train_iters=100"])))
    chain = Chain(paths, RecordingScheduler())
    chain.begin("8")
    paths.segment_log("8").write_text("iteration 49 loss 3.2\nTraceback (most recent call last):\n"
                                      "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 "
                                      "vs 598\nsrun: error: vm: task 0: Exited with exit code 1\n")
    _outcome(monkeypatch, paths, "8", "failed", reason="CheckpointException ranks:dict_keys([0])")
    assert not chain.end("8", 1).proceed
    (ended,) = events(paths, "ended")
    assert ended["outcome"] == "storage_full" and "unexpected pos 704 vs 598" in ended["storage"]["evidence"]
    assert events(paths, "node_suspected") == []


def test_status_json_has_the_figures(tmp_path: Path) -> None:
    paths = write_run(prepare_run(load_recipe("tiny", [f"run.root={tmp_path}"])))
    (paths.checkpoints / "iter_0000050").mkdir()
    (paths.checkpoints / "iter_0000050" / "__0_0.distcp").write_bytes(b"\1" * 100_000)
    st = run_status(paths)["storage"]
    assert st["count"] == 1 and st["bytes"] >= 100_000
    assert st["predicted_bytes"] == pytest.approx(1_835_336, rel=0.005) and math.isclose(
        st["peak_bytes"], 3 * st["predicted_bytes"])
    json.dumps(st)
