"""A real, small filesystem for tests of disk budgets and full disks: a tmpfs mounted for the test
(`mount -t tmpfs -o size=64m`), unmounted afterwards. Skipped, saying why, where mounting is not
permitted (not root, or a container without CAP_SYS_ADMIN)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(directory: Path, size: str = "64m", *, inodes: int | None = None) -> Iterator[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (mount -t tmpfs); run as root or in CI's container")
    options = f"size={size},mode=0755" + (f",nr_inodes={inodes}" if inodes is not None else "")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {(p.stderr or p.stdout).strip()}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)  # busy: detach it anyway


def fill(directory: Path, leave_bytes: int) -> Path:
    """Fill the filesystem of `directory` until `leave_bytes` (or less) are free, from outside a run."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    path = directory / "filler.bin"
    with open(path, "wb") as f:
        remaining = max(free - leave_bytes, 0)
        chunk = b"\0" * (1 << 20)
        while remaining > 0:
            n = min(remaining, len(chunk))
            f.write(chunk[:n])
            remaining -= n
    return path
