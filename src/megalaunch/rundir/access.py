"""Who may read and write a run directory: its Unix group (the directory is 2770, setgid)."""

from __future__ import annotations

import getpass
import grp
import os
from pathlib import Path

from megalaunch.errors import RunDirError


def group_name(path: Path) -> str:
    """The group of `path`, or of the nearest directory above it that this user may stat: inside a
    2770 run directory an outsider can stat nothing, but the run directory itself they can."""
    for p in [path.absolute(), *path.absolute().parents]:
        try:
            gid = p.stat().st_gid
        except OSError:
            continue
        try:
            return grp.getgrgid(gid).gr_name
        except KeyError:
            return str(gid)
    return "?"


def not_in_group(p: Path) -> RunDirError:
    return RunDirError(f"you ({getpass.getuser()}) cannot read {p}: only members of the run's group "
                       f"'{group_name(p)}' can", fix="ask the run's owner to add you to that group")


def require_writable(*directories: Path) -> None:
    """Refuse, naming the run's group, when this user may not create files in one of `directories`."""
    for d in directories:
        if not os.access(d, os.W_OK | os.X_OK):
            raise RunDirError(f"you ({getpass.getuser()}) cannot write {d}: only members of the run's group "
                              f"'{group_name(d)}' can", fix="ask the run's owner to add you to that group")


def run_owner(root: Path) -> str:
    import pwd

    uid = root.stat().st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def require_owner(root: Path, action: str, member_fix: str) -> None:
    """Actions that queue jobs or change what the owner's job trusts are the owner's alone
    (docs/security.md, "What members may do"): a member gets one line naming the owner and what a member
    can do instead. Root may act for anyone."""
    try:
        uid = root.stat().st_uid
    except OSError:
        return  # find_run already said what is wrong with the path
    if os.getuid() in (0, uid):
        return
    raise RunDirError(f"only the run's owner ({run_owner(root)}) can {action} it: that queues jobs and changes files "
                      "the owner's job trusts", fix=member_fix)
