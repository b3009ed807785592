"""`backend_for(name)`: the only place that maps `cluster.backend` to code. Nothing else compares
backend names. To add a backend, implement `launcher.chain.backend.Backend` and add it here."""

from __future__ import annotations

from collections.abc import Callable

from megalaunch.errors import RunDirError
from megalaunch.launcher.chain.backend import Backend


def _slurm() -> Backend:
    from megalaunch.launcher.backends.slurm_backend import SlurmBackend

    return SlurmBackend()


def _local() -> Backend:
    from megalaunch.launcher.backends.local import LocalBackend

    return LocalBackend()


# imported when chosen: `job begin` on a compute node loads only the Slurm side
_BACKENDS: dict[str, Callable[[], Backend]] = {"slurm": _slurm, "local": _local}


def backend_for(name: str) -> Backend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise RunDirError(f"unknown backend {name!r}", valid=" | ".join(_BACKENDS)) from None
