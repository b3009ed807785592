"""Megatron-core checkpoint directories as `megatron.training` writes and reads them, and which
complete checkpoint a path means (`resolve`: a run directory, a checkpoint directory or an iteration).

Layout:
    CKPT/latest_checkpointed_iteration.txt      "N" or "release", written last (atomically)
    CKPT/iter_000000N/ (or CKPT/release/)        metadata.json, .metadata, __0_*.distcp
An iteration directory is complete when metadata.json names torch_dist (or, Megatron-FSDP's fsdp_dtensor,
there is none: fsdp_layout.py) and every data file that .metadata references is there and long enough
(`check_complete`); one newer than the tracker may be
half written. Reading the tensors is mcore_dist.py's and mcore_direct.py's, writing them mcore_save.py's."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megalaunch.conversion.errors import ConversionError, IncompleteCheckpointError, MissingFileError
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.completeness import is_fsdp_dtensor

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"


def iteration_dir_name(iteration: int | None) -> str:
    return RELEASE if iteration is None else f"iter_{iteration:07d}"


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint: its directory and iteration (None for a release checkpoint)."""

    path: Path
    iteration: int | None


def read_tracker(root: Path) -> int | None:
    """The tracker's iteration (None for "release"); raises if it is absent or garbled."""
    tracker = root / TRACKER
    if not tracker.is_file():
        raise IncompleteCheckpointError(f"no {TRACKER} in {root}: no complete checkpoint was saved there",
                                        fix="pass the checkpoint directory a training run saved into, "
                                            "or --iteration N for a specific iter_N directory")
    text = tracker.read_text().strip()
    if text == RELEASE:
        return None
    if not text.isdigit():
        raise IncompleteCheckpointError(f"{tracker} holds {text!r}, not an iteration or 'release'")
    return int(text)


def checkpoint_root(path: Path) -> Path:
    """A run directory -> its checkpoints/; a checkpoint directory stays itself."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{path} does not exist")
    run = RunPaths(path)  # a run directory: its checkpoints/
    if run.checkpoints.is_dir() and not (path / TRACKER).exists():
        return run.checkpoints
    return path


def _refuse_untracked(root: Path, iteration: int) -> None:
    """Megatron updates the tracker after a save completes: an iteration beyond it may be half written."""
    if not (root / TRACKER).is_file():
        return
    tracked = read_tracker(root)
    if tracked is not None and iteration > tracked:
        raise IncompleteCheckpointError(f"iteration {iteration} is newer than the tracker's {tracked} in {root}: "
                                        "it may be incomplete (still being written, or interrupted)",
                                        fix=f"use --iteration {tracked} or leave --iteration out")


def resolve(path: Path, iteration: int | None = None, *, shards: bool = True) -> CheckpointRef:
    """Find the complete checkpoint meant by `path`: a run directory, a checkpoint directory (its
    tracker, or `iteration`), or an iteration directory itself. `shards=False`: everything but reading
    .metadata and the shards it names (no torch: the CLI asks that much before importing it)."""
    path = Path(path)
    if ((path / "metadata.json").is_file() or is_fsdp_dtensor(path)) and iteration is None:
        name = path.name
        it = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
        if it is not None:
            _refuse_untracked(path.parent, it)
        check_complete(path, shards=shards)
        return CheckpointRef(path, it)
    root = checkpoint_root(path)
    if iteration is None:
        tracked = read_tracker(root)
        ref = CheckpointRef(root / iteration_dir_name(tracked), tracked)
        if not ref.path.is_dir():
            raise IncompleteCheckpointError(f"the tracker in {root} points at {ref.path.name}, which does not exist")
    else:
        _refuse_untracked(root, iteration)
        ref = CheckpointRef(root / iteration_dir_name(iteration), iteration)
        if not ref.path.is_dir():
            have = sorted(p.name for p in root.glob("iter_*"))
            raise MissingFileError(f"{ref.path} does not exist", valid=", ".join(have) or "no iter_* directories")
    check_complete(ref.path, shards=shards)
    return ref


def check_complete(ckpt: Path, *, shards: bool = True) -> None:
    """metadata.json names torch_dist, .metadata exists, and (`shards`) every data file it references is
    there and long enough."""
    meta = ckpt / "metadata.json"
    if is_fsdp_dtensor(ckpt):  # Megatron-FSDP's: the torch.distributed.checkpoint part alone
        if shards:
            _check_shards(ckpt)
        return
    if not meta.is_file():
        raise IncompleteCheckpointError(f"{ckpt} has no metadata.json: the save did not finish")
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except json.JSONDecodeError as e:
        raise IncompleteCheckpointError(f"{meta} is not valid JSON ({e.msg})") from None
    if backend != "torch_dist":
        raise ConversionError(f"{ckpt} is a {backend!r} checkpoint; only torch_dist converts",
                              fix="save with --ckpt-format torch_dist (megalaunch's default)")
    if not (ckpt / ".metadata").is_file():
        raise IncompleteCheckpointError(f"{ckpt} has no .metadata: the save did not finish")
    if shards:
        _check_shards(ckpt)


def _check_shards(ckpt: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as e:  # a truncated pickle raises anything
        raise IncompleteCheckpointError(f"{ckpt}/.metadata is unreadable ({type(e).__name__})") from None
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in need.items():
        f = ckpt / rel
        if not f.is_file():
            raise IncompleteCheckpointError(f"{ckpt} lacks data file {rel}")
        if f.stat().st_size < size:
            raise IncompleteCheckpointError(f"{f} is truncated ({f.stat().st_size} of {size} bytes)")


def write_tracker(root: Path, iteration: int | None) -> None:
    """Point the tracker at `iteration` (None: release), atomically, once the checkpoint is complete."""
    tmp = root / (TRACKER + ".tmp")
    tmp.write_text(("release" if iteration is None else str(iteration)) + "\n")
    os.replace(tmp, root / TRACKER)
