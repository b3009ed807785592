"""One error hierarchy. Every user-facing failure is a MegalaunchError whose str() is one line:
what was wrong (naming the field), what is valid, and how to fix it. The CLI prints that line and
exits non-zero; `--debug` shows the traceback."""

from __future__ import annotations


class MegalaunchError(Exception):
    """Base class. `field` names the offending recipe field or argument, `valid` what would be
    accepted, `fix` the command or change that repairs it."""

    exit_code = 2

    def __init__(self, message: str, *, field: str | None = None, valid: str | None = None,
                 fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.valid = valid
        self.fix = fix

    def __str__(self) -> str:
        # one prefix: a message that already starts with its field is not prefixed again
        named = self.field and not self.message.startswith((f"{self.field}.", f"{self.field} ", f"{self.field}:"))
        parts = [f"{self.field}: {self.message}" if named else self.message]
        if self.valid:
            parts.append(f"valid: {self.valid}")
        if self.fix:
            parts.append(f"fix: {self.fix}")
        return " | ".join(p.replace("\n", " ") for p in parts)


class ConfigError(MegalaunchError):
    """A recipe, override or cluster profile is malformed (unknown key, wrong type, bad value)."""


class PreflightError(MegalaunchError):
    """The recipe is well-formed but cannot run (parallelism arithmetic, missing data, time limit)."""


class RunDirError(MegalaunchError):
    """A run directory is missing, not ours, or cannot be written."""


class SlurmError(MegalaunchError):
    """Slurm is missing, down, timed out, or refused a request."""

    exit_code = 3


class RemoteError(MegalaunchError):
    """Reaching the login node over SSH failed (host, key, host key), or megalaunch is missing there.
    Exit status 255, as OpenSSH's own failures."""

    exit_code = 255


class DependencyError(MegalaunchError):
    """An optional dependency is missing; the message carries the exact pip install hint."""


def require(module: str, extra: str) -> None:
    """Fail with the install hint when an optional dependency is absent (checked without importing it)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise DependencyError(f"this command needs the Python package '{module}'",
                              fix=f"pip install 'megalaunch[{extra}]'")
