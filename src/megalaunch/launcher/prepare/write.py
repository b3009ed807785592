"""Write a prepared run into place: a temporary directory next to the final one, renamed into place,
so a failure leaves nothing behind; the run's group, the modes of its directories (docs/security.md),
the frozen tokenizer, the code snapshot (`debug.code_snapshot`) and the manifest with the hashes the
job checks before it runs anything."""

from __future__ import annotations

import getpass
import grp
import hashlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from megalaunch import __version__
from megalaunch.errors import PreflightError, RunDirError
from megalaunch.launcher.prepare.prepare import PreparedRun
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.trust import (
    RUN_DIR_MODE,
    TEAM_DIR_MODE,
    TRIGGER_DIR_MODE,
    check_ancestors,
    file_hashes,
)


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise PreflightError(f"group '{group}' does not exist", field="run.group",
                             fix="use a group from `id -Gn`") from None
    if os.getuid() != 0 and gid not in os.getgroups():
        raise PreflightError(f"you are not a member of group '{group}'", field="run.group",
                             valid=", ".join(grp.getgrgid(g).gr_name for g in os.getgroups()),
                             fix="choose one of your groups")
    return gid


def write_run(prepared: PreparedRun) -> RunPaths:
    """Create the run directory atomically (temp dir + rename): the owner writes, the run's group reads
    (umask 027, 2750), members write only triggers/ (3770; docs/security.md)."""
    recipe = prepared.recipe
    paths = prepared.paths
    gid = _group_id(recipe.run.group)
    root = paths.root.parent
    check_ancestors(paths.root)  # nobody else can rename the run (or a directory above it) away
    old_umask = os.umask(0o027)
    try:
        try:
            if not root.exists():
                root.mkdir(parents=True)
                if gid is not None:  # the team reaches its runs; sticky: nobody renames another's
                    os.chown(root, -1, gid)
                    os.chmod(root, TEAM_DIR_MODE)
        except OSError as e:
            raise RunDirError(f"cannot create the run root {root}: {e.strerror}", field="run.root",
                              fix="choose a writable directory: --set run.root=/path") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise RunDirError(f"the run root {root} is not writable", field="run.root",
                              fix="choose a writable directory: --set run.root=/path")
        if paths.root.exists():
            raise RunDirError(f"{paths.root} already exists", fix="choose another --name")
        tmp = root / f".{paths.root.name}.partial"
        try:
            _populate(tmp, prepared, gid)
            os.rename(tmp, paths.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        os.umask(old_umask)
    return paths


def _populate(tmp: Path, prepared: PreparedRun, gid: int | None) -> None:
    recipe = prepared.recipe
    tmp.mkdir()
    if gid is not None:
        os.chown(tmp, -1, gid)
    os.chmod(tmp, RUN_DIR_MODE)
    t = RunPaths(tmp)
    for d in (t.triggers, t.consumed_triggers, t.checkpoints, t.logs, t.state, t.debug):
        d.mkdir(parents=True)
    # the only place members write: group-writable whatever the umask, sticky (consumed/ is the owner's)
    os.chmod(t.triggers, TRIGGER_DIR_MODE)
    for rel, content in prepared.files.items():
        (tmp / rel).write_text(content)
    if "job.sbatch" in prepared.files:
        os.chmod(t.job_script, 0o750)
    if prepared.tokenizer is not None:
        t.tokenizer.mkdir()
        for name, data in prepared.tokenizer.files().items():
            (t.tokenizer / name).write_bytes(data)
    snapshot = recipe.debug.code_snapshot
    if snapshot:
        _snapshot_code(Path(os.path.expanduser(snapshot)), t.code_snapshot)
    manifest = {
        "megalaunch_version": __version__,
        "chain_name": prepared.chain_name,
        "run_dir": str(prepared.paths.root),
        "user": getpass.getuser(),
        "host": socket.gethostname(),
        "created": time.time(),
        "recipe_source": prepared.loaded.source,
        "recipe_sha256": hashlib.sha256(prepared.files["run.yaml"].encode()).hexdigest(),
        "data_blend_sha256": prepared.blend_sha256,
        "trusted_sha256": file_hashes(prepared.files),  # what the job checks before it runs anything
        "tokenizer": prepared.tokenizer.record() if prepared.tokenizer is not None else None,
        "backend": recipe.cluster.backend,
        "code": code_revision(Path(os.path.expanduser(snapshot))) if snapshot
        else code_revision(Path(__file__).resolve().parent),
        "world_size": prepared.topology.world_size,
        "data_parallel_size": prepared.topology.dp,
    }
    import json

    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    t.ledger.touch()
    os.chmod(t.ledger, 0o640)


def _snapshot_code(src: Path, dst: Path) -> None:
    """Copy the tracked files of a git checkout (or the whole tree) into RUN/code. Fails loudly."""
    if not src.is_dir():
        raise PreflightError(f"{src} is not a directory", field="debug.code_snapshot",
                             fix="point it at your source tree or set it to null")
    try:
        listed = subprocess.run(["git", "-C", str(src), "ls-files", "-z"], capture_output=True, timeout=60)
        names = [n for n in listed.stdout.decode().split("\0") if n] if listed.returncode == 0 else None
        if names is None:
            shutil.copytree(src, dst, symlinks=True)
            return
        for name in names:
            target = dst / name
            target.parent.mkdir(parents=True, exist_ok=True)
            s = src / name
            if s.is_symlink():
                os.symlink(os.readlink(s), target)
            elif s.is_file():
                shutil.copy2(s, target)
    except (OSError, shutil.Error, subprocess.TimeoutExpired) as e:
        raise RunDirError(f"code snapshot of {src} failed: {e}", field="debug.code_snapshot",
                          fix="fix the source tree or set debug.code_snapshot to null") from None


def code_revision(path: Path) -> dict[str, Any]:
    """git revision of `path` (+ a hash of the diff when dirty), or {} when not a git checkout."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout if p.returncode == 0 else None

    rev = git("rev-parse", "HEAD")
    if rev is None:
        return {}
    diff = git("diff", "HEAD") or ""
    return {"revision": rev.strip(), "dirty": bool(diff),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}
