"""Python's bytecode cache for the trainer where the environment turned it off (issue #25, start-up).

Container images often set PYTHONDONTWRITEBYTECODE=1 (to keep the image clean), and then every
process start compiles torch's and Megatron's sources again: on one H100 machine's image,
`import megatron.training.training` took 11.5 s every time, 4.8 s with the bytecode cached. Every rank
of every segment (and every restart) pays that. So when bytecode writing is off, the trainer writes
it under RUN/state/pycache instead (`sys.pycache_prefix`: nothing is written next to the installed
sources, which is what the setting was for): the first segment of a run compiles, the others read.
RUN/state is the owner's (2750), so no team member can plant bytecode the job would run.
Only where the packages were installed without bytecode (torch's `__init__` has no `.pyc` beside it):
a pip install compiles them, and a prefix would then make Python ignore that bytecode and compile
everything again, once per run. MEGALAUNCH_BYTECODE_CACHE=0 leaves Python's setting alone."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from pathlib import Path

BYTECODE_ENV = "MEGALAUNCH_BYTECODE_CACHE"


def installed_with_bytecode(package: str) -> bool:
    """Whether `package` (found, not imported) has its bytecode next to its sources: pip compiles at
    install, and then a prefix would only make Python compile everything again into it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    return os.path.exists(importlib.util.cache_from_source(spec.origin))


def enable_cache(directory: Path, probe: str = "torch") -> str | None:
    """Turn bytecode writing on, into `directory`, if the environment turned it off and `probe` (the
    heaviest import) was installed without bytecode; returns what was done (for the log), or None when
    Python writes or finds bytecode already (or it was asked to stay off)."""
    if not sys.dont_write_bytecode or os.environ.get(BYTECODE_ENV, "1") == "0":
        return None
    if installed_with_bytecode(probe):
        return None
    try:
        directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError as e:
        return f"bytecode cache not enabled ({e})"
    # Python runs what it finds there: only a directory of ours that nobody else can write (an older,
    # group-writable run might hold one a member made)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return f"bytecode cache not enabled: {directory} is not a directory only this user can write"
    sys.pycache_prefix = str(directory)
    sys.dont_write_bytecode = False
    # the ranks' own children (data-loader workers, the checkpoint writer) start with the same setting
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(directory)
    return f"PYTHONDONTWRITEBYTECODE is set: bytecode cached under {directory} instead"
