"""When a checkpoint directory is complete, the only kind megalaunch trusts (runtime/checkpoint/resume.py).

A `torch_dist` checkpoint is complete when Megatron's `metadata.json` and torch.distributed.checkpoint's
`.metadata` (written last, when every rank has finished) exist and parse, and every shard file that
`.metadata` refers to exists and is long enough for the byte ranges it lists (a truncated or missing
shard fails this). An `fsdp_dtensor` checkpoint (Megatron-FSDP) has no `metadata.json`: the rest holds
(`is_fsdp_dtensor` tells it by its keys). A legacy `torch` checkpoint is complete when each `mp_rank_*` directory holds a
non-empty `model_optim_rng.pt`. Standard library only (the full check unpickles `.metadata`, which
needs torch's classes to be importable)."""

from __future__ import annotations

from pathlib import Path


def incomplete_reason(directory: Path, *, full: bool = True) -> str | None:
    """None when the checkpoint in `directory` is complete, else why not (one line).

    `full=False` is the login node's check, without torch (`megalaunch resume --from`): it reads
    `.metadata` as a pickle stream without loading it, so it sees which shard files it names and that
    they are there and not empty, but not how many bytes each must hold; the job checks that."""
    if not directory.is_dir():
        return "missing"
    if is_fsdp_dtensor(directory):  # Megatron-FSDP's: a torch.distributed.checkpoint alone
        return _dcp_incomplete(directory, full=full)
    if (directory / "metadata.json").exists() or (directory / ".metadata").exists():
        return _torch_dist_incomplete(directory, full=full)
    shards = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))
    if shards:
        empty = [s for s in shards if s.stat().st_size == 0]
        return f"empty {empty[0].relative_to(directory)}" if empty else None
    return "no metadata.json, .metadata or mp_rank_*/model_optim_rng.pt"


FSDP_KEY = b"model.module."  # how every model tensor's key begins in an fsdp_dtensor checkpoint; torch_dist's do not


def is_fsdp_dtensor(directory: Path) -> bool:
    """Whether `directory` holds Megatron-FSDP's fsdp_dtensor format: a `.metadata` naming `model.module.*` keys and
    no metadata.json. By content, not by the missing file alone: torch_dist writes metadata.json after its
    `.metadata`, so a torch_dist save cut between the two must stay incomplete."""
    meta = directory / ".metadata"
    if (directory / "metadata.json").exists() or not meta.is_file():
        return False
    try:  # read until the key is found (it comes early): `status` checks every checkpoint on disk
        with open(meta, "rb") as f:
            tail = b""
            while chunk := f.read(1 << 20):
                if FSDP_KEY in tail + chunk:
                    return True
                tail = chunk[-(len(FSDP_KEY) - 1):]
    except OSError:
        return False
    return False


def _torch_dist_incomplete(directory: Path, *, full: bool = True) -> str | None:
    for name in ("metadata.json", ".metadata", "common.pt"):
        path = directory / name
        if not path.exists():
            if name == "common.pt":  # older Megatron versions only; 0.19 keeps it in the shards
                continue
            return f"missing {name}"
        if path.stat().st_size == 0:
            return f"empty {name}"
    try:
        import json

        json.loads((directory / "metadata.json").read_text())
    except (ValueError, OSError) as e:
        return f"unreadable metadata.json ({e})"
    return _dcp_incomplete(directory, full=full)


def _dcp_incomplete(directory: Path, *, full: bool = True) -> str | None:
    """torch.distributed.checkpoint's part: `.metadata` there, and every shard file it names long enough."""
    if (directory / ".metadata").stat().st_size == 0:
        return "empty .metadata"
    if not full:
        return _shards_missing(directory)
    try:
        needed = _dcp_extents(directory / ".metadata")
    except Exception as e:  # a pickle that fails to load is the same as a missing one
        return f"unreadable .metadata ({type(e).__name__}: {e})"
    for rel, end in sorted(needed.items()):
        path = directory / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"missing shard {rel}"
        if size < end:
            return f"truncated shard {rel} ({size} < {end} bytes)"
    return None


def _shards_missing(directory: Path) -> str | None:
    """Without torch: the shard files `.metadata` names exist and are not empty."""
    try:
        names = _dcp_shard_names(directory / ".metadata")
    except Exception as e:  # a truncated or garbled pickle stream
        return f"unreadable .metadata ({type(e).__name__}: {e})"
    if not names:  # a layout this reader does not know: at least the shard files must be there
        names = {p.name for p in directory.glob("*.distcp")}
        if not names:
            return "no shard file (*.distcp)"
    for rel in sorted(names):
        try:
            size = (directory / rel).stat().st_size
        except FileNotFoundError:
            return f"missing shard {rel}"
        if size == 0:
            return f"empty shard {rel}"
    return None


def _dcp_shard_names(metadata_file: Path) -> set[str]:
    """The shard files (`*.distcp`) torch.distributed.checkpoint's `.metadata` names, read from the
    pickle's opcodes without running it (no torch needed; nothing in the file is executed)."""
    import pickletools

    with open(metadata_file, "rb") as f:
        data = f.read()
    return {arg for _, arg, _ in pickletools.genops(data)
            if isinstance(arg, str) and arg.endswith(".distcp") and not arg.startswith("/")
            and ".." not in arg.split("/")}


def _dcp_extents(metadata_file: Path) -> dict[str, int]:
    """Shard file -> bytes it must hold, from torch.distributed.checkpoint's `.metadata`."""
    import pickle

    with open(metadata_file, "rb") as f:
        meta = pickle.load(f)
    extents: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    return extents
