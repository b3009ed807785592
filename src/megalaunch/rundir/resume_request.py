"""`megalaunch resume RUN --from ITER`'s one-shot request: state/resume_request.json.

The CLI writes it (atomically) before it starts the chain's next segment; rank 0 of the first segment
that trains applies it (`runtime.checkpoint.resume.plan_resume`) and renames it to
`resume_request.done-<job>.json` (or `.refused-<job>.json` when the checkpoint turns out unusable),
so the segments after it resume from their newest checkpoint again. It is a file in the run directory,
not an environment variable: a segment queues its successor from inside the job, and the successor
would inherit the variable and apply the request again."""

from __future__ import annotations

import getpass
import os
import socket
import time
from pathlib import Path
from typing import Any

from megalaunch.rundir.files import atomic_write_json, read_json
from megalaunch.rundir.paths import RunPaths


def write_resume_request(paths: RunPaths, iteration: int) -> dict[str, Any]:
    record = {"iteration": int(iteration), "user": _user(), "uid": os.getuid(), "host": socket.gethostname(),
              "time": time.time()}
    atomic_write_json(paths.resume_request, record)
    return record


def read_resume_request(paths: RunPaths) -> dict[str, Any] | None:
    """The pending request, or None when there is none. A file that is not a request (garbled, or its
    iteration is not a whole number >= 0) raises ValueError: the job refuses it like an unusable one."""
    if not paths.resume_request.exists():
        return None
    data = read_json(paths.resume_request)
    iteration = data.get("iteration") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ValueError(f"{paths.resume_request} is not a resume request (expected JSON with a whole-number "
                         f"'iteration'; it holds {_preview(paths.resume_request)})")
    return data


def requested_iteration(paths: RunPaths) -> int | None:
    """The pending request's iteration; None when there is none or it is garbled (the job refuses that)."""
    try:
        request = read_resume_request(paths)
    except ValueError:
        return None
    return request["iteration"] if request else None


def settle_resume_request(paths: RunPaths, how: str, job_id: str | None) -> Path | None:
    """Rename the pending request out of the way (`how`: done, refused, withdrawn); its new path, or
    None when there was none."""
    target = paths.settled_resume_request(how, job_id)
    try:
        os.replace(paths.resume_request, target)
    except FileNotFoundError:
        return None
    return target


def withdraw_resume_request(paths: RunPaths) -> dict[str, Any] | None:
    """Take back a pending request that no segment has applied yet; what it asked, or None."""
    try:
        request = read_resume_request(paths)
    except ValueError:
        request = {"iteration": None}
    if request is None:
        return None
    return request if settle_resume_request(paths, "withdrawn", str(int(time.time()))) else None


def _preview(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"nothing readable: {e}"
    return repr(text[:60]) if text else "nothing"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "?"
