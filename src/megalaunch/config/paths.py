"""One rule for `~` and `$VAR` in the recipe fields that name a file or directory.

In every path field (the schema marks them: `doc(..., path=True)`; `megalaunch recipes show
--explain` says "path" for each), a leading `~` or `~user` and each `$NAME` or `${NAME}` are
expanded once, when the recipe is loaded on the machine you submit from, with your environment.
`run.yaml` records the expanded path, so every segment, successor and teammate sees the same one;
nothing is expanded again later, on a compute node or inside a container. A variable that is not
set, or a `~user` that names no user, is an error naming the field. A `$` not followed by a name
stays a `$`. Container-side paths (`container.workdir`, the DST of `container.mounts`) are never
expanded: the host's home is not the container's. No other field is expanded: a `$` in an
environment value or a Megatron argument reaches the job as written (docs/recipes in the README)."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from megalaunch.errors import ConfigError

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")

PATH = "path"     # a host path: expanded
MOUNT = "mount"   # SRC:DST[:flags]: SRC expanded, DST left as written


def expand_path(value: str, field: str, env: Mapping[str, str] | None = None) -> str:
    """`value` with a leading ~/~user and every $NAME/${NAME} expanded, once."""
    env = os.environ if env is None else env
    text = value
    if text.startswith("~"):
        head, sep, rest = text.partition("/")
        if head == "~":
            home = env.get("HOME") or os.path.expanduser("~")
        else:
            home = os.path.expanduser(head)
            if home == head:
                raise ConfigError(f"{head} names no user on this machine", field=field,
                                  valid="~/..., ~USER/... of an existing user, or an absolute path",
                                  fix=f"write the absolute path in {field}")
        text = home + sep + rest

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ConfigError(f"${name} is not set in this shell (paths are expanded when the recipe is loaded)",
                              field=field, valid="a path; $NAME of a variable set where you submit",
                              fix=f"export {name}=... before submitting, or write the path out in {field}")
        return env[name]

    return _VAR.sub(sub, text)


def _expand_mount(value: str, field: str, env: Mapping[str, str] | None) -> str:
    src, sep, rest = value.partition(":")
    return expand_path(src, field, env) + sep + rest


def expand_paths(obj: Any, prefix: str = "", env: Mapping[str, str] | None = None) -> Any:
    """A copy of the (frozen) recipe dataclass `obj` with every path field expanded."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        field = f"{prefix}{f.name}"
        kind = f.metadata.get("path")
        if kind in (PATH, MOUNT):
            one = _expand_mount if kind == MOUNT else expand_path
            if isinstance(value, str):
                new: Any = one(value, field, env)
            elif isinstance(value, (list, tuple)):
                new = type(value)(one(v, f"{field}[{i}]", env) if isinstance(v, str) else v
                                  for i, v in enumerate(value))
            else:
                new = value
        elif dataclasses.is_dataclass(value):
            new = expand_paths(value, field + ".", env)
        elif isinstance(value, (list, tuple)) and any(dataclasses.is_dataclass(v) for v in value):
            new = type(value)(expand_paths(v, f"{field}[{i}].", env) for i, v in enumerate(value))
        else:
            continue
        if new != value:
            changes[f.name] = new
    return dataclasses.replace(obj, **changes) if changes else obj


def path_fields(cls: Any, prefix: str = "") -> list[str]:
    """Dotted names of the path fields of a recipe schema (for the docs and the tests)."""
    import typing

    from megalaunch.config.typed import field_types

    out = []
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("path"):
            out.append(f"{prefix}{f.name}")
            continue
        tp = hints[f.name]
        for candidate in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(candidate):
                out += path_fields(candidate, f"{prefix}{f.name}" + ("[]." if typing.get_origin(tp) is list else "."))
    return out
