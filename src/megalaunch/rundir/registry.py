"""Which runs `megalaunch status` (no argument) lists: the user's own registered runs
($XDG_STATE_HOME/megalaunch/runs) and every run they can read under the run roots they know: the
roots of their own runs, roots they named in `MEGALAUNCH_RUN_ROOTS` (os.pathsep-separated), and the
root of any run directory they passed to a command (a teammate who once ran `megalaunch status
/scratch/team/runs/x` then sees the team's other runs there too). Readable means the run directory
lets them in: its group is theirs (runs are 2770)."""

from __future__ import annotations

import os
from pathlib import Path

ROOTS_ENV = "MEGALAUNCH_RUN_ROOTS"


def _state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "megalaunch"


def registry_file() -> Path:
    return _state_dir() / "runs"


def roots_file() -> Path:
    return _state_dir() / "roots"


def _append_line(f: Path, line: str) -> None:
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "a") as out:
            out.write(f"{line}\n")
    except OSError:
        pass  # a missing registry costs only the no-argument status listing


def _lines(f: Path) -> list[str]:
    try:
        text = f.read_text()
    except OSError:
        return []
    return list(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))


def register(run_dir: Path) -> None:
    _append_line(registry_file(), str(run_dir))


def remember_root(run_dir: Path) -> None:
    """Note the root of a run directory the user named (once)."""
    root = str(Path(run_dir).parent)
    if root not in _lines(roots_file()):
        _append_line(roots_file(), root)


# What a run listing reads of every run: in a colleague's run these must be plain files (or absent), or a
# FIFO or link they planted there would hang or redirect the listing (docs/security.md).
LISTED_FILES = ("run.yaml", "manifest.json", "runtime.json", "state/ledger.jsonl", "state/progress.json",
                "state/outcome.json", "state/metrics.jsonl", "state/goodput.json",
                "checkpoints/latest_checkpointed_iteration.txt")


def _readable_run(p: Path) -> bool:
    import stat

    try:
        if not os.access(p / "run.yaml", os.R_OK):
            return False
        if os.lstat(p).st_uid == os.getuid():
            return True
        for rel in LISTED_FILES:
            try:
                if not stat.S_ISREG(os.lstat(p / rel).st_mode):
                    return False
            except FileNotFoundError:
                continue
        return True
    except OSError:
        return False


def registered_runs() -> list[Path]:
    return [Path(p) for p in _lines(registry_file()) if _readable_run(Path(p))]


def known_runs() -> list[Path]:
    """The user's runs, then the other readable runs under every known root, each once."""
    own = registered_runs()
    roots = [*(p.parent for p in own), *(Path(r) for r in _lines(roots_file())),
             *(Path(r) for r in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if r)]
    seen = {str(p) for p in own}
    out = list(own)
    for root in dict.fromkeys(roots):
        try:
            entries = sorted(root.iterdir())
        except OSError:
            continue
        for p in entries:
            if not p.name.startswith(".") and str(p) not in seen and _readable_run(p):
                seen.add(str(p))
                out.append(p)
    return out
