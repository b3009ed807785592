"""Build frozen dataclasses from plain dicts, strictly.

Unknown keys are errors with a "did you mean"; values are checked against the annotated types with a
small set of coercions users expect (`5e-4` written in YAML arrives as a string and is a float; an int
is a valid float). Every error names the dotted field path. Fields document themselves through
`field(metadata={"doc": ...})`."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from megalaunch.errors import ConfigError


def field_types(cls: Any) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, evaluated once per class (the schema's dataclasses do not change; the
    evaluation compiles every annotation string, ~20 ms per recipe load). Read it, never change it."""
    return _field_types(cls)


_field_types: Callable[[Any], dict[str, Any]] = functools.cache(get_type_hints)

_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def doc(text: str, default: Any = dataclasses.MISSING, *, path: str | None = None, **kw: Any) -> Any:
    """A dataclass field with a docstring (shown by `recipes show --explain` and in errors).
    `path="path"` (or "mount") marks a field naming a file or directory: config/paths.py expands
    its ~ and $VAR when the recipe is loaded."""
    meta = {"doc": text, **({"path": path} if path else {})}
    if isinstance(default, list):  # lists are stored as tuples: the dataclasses are frozen
        return dataclasses.field(default=tuple(default), metadata=meta, **kw)
    if isinstance(default, dict):
        value = default
        return dataclasses.field(default_factory=lambda: dict(value), metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


def did_you_mean(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


_SECRET_WORDS = ("key", "token", "secret", "password", "passwd")


def looks_like_megatron_flag(name: str) -> bool:
    """A snake_case name that is not secret-like: worth suggesting `megatron_args` for."""
    return bool(re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", name)) and not any(w in name for w in _SECRET_WORDS)


def fields_named(cls: Any, name: str, prefix: str = "") -> list[str]:
    """Dotted paths of every field called `name` in dataclass `cls` and the dataclasses inside it."""
    out = []
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if f.name == name and prefix:
            out.append(path)
        if dataclasses.is_dataclass(hints[f.name]):
            out += fields_named(hints[f.name], name, path + ".")
    return out


class UnknownKeyError(ConfigError):
    """A key the schema does not have: the closest names, the section that has it, or megatron_args."""

    def __init__(self, key: str, field: str, names: typing.Iterable[str], root: Any = None) -> None:
        close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
        elsewhere = [p for p in fields_named(root, key) if p != field.removeprefix("--set ")] if root else []
        message = f"unknown key{did_you_mean(key, close)}"
        if elsewhere:
            message += f"; '{key}' is a field of {' and '.join(p.rsplit('.', 1)[0] for p in elsewhere)}"
            fix = f"move it: {elsewhere[0]}"
        elif not close and looks_like_megatron_flag(key):
            fix = f"remove it, or pass a Megatron flag the schema lacks as megatron_args.{key}"
        else:
            fix = "remove it"
        super().__init__(message, field=field, fix=fix)
        self.key, self.names, self.has_root = key, list(names), root is not None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _float(text: str) -> float:
    """float() of text _FLOAT_RE matched once stripped: str.strip() also strips what float() does
    not (U+001F, ...), so strip first; nan for what still does not parse (refused as not finite)."""
    try:
        return float(text.strip())
    except (ValueError, OverflowError):
        return math.nan


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Check/convert `value` to type `tp`; raise ConfigError naming `path` otherwise. One function per
    annotation kind: the generic forms by their origin, then dataclasses, then the scalars."""
    if tp is Any:
        return value
    by_origin = _BY_ORIGIN.get(get_origin(tp))
    if by_origin is not None:
        return by_origin(value, tp, path)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    scalar = _SCALARS.get(tp)
    if scalar is not None:
        return scalar(value, path)
    raise TypeError(f"unsupported annotation {tp!r} at {path}")  # a bug in the schema, not user error


def _to_union(value: Any, tp: Any, path: str) -> Any:
    """The first member type that takes `value` (None where the union holds it)."""
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        with contextlib.suppress(ConfigError):
            return coerce(value, arg, path)
    raise ConfigError(f"got {value!r} ({type(value).__name__})", field=path, valid=_type_name(tp))


def _to_literal(value: Any, tp: Any, path: str) -> Any:
    if value in get_args(tp):
        return value
    raise ConfigError(f"got {value!r}{did_you_mean(str(value), map(str, get_args(tp)))}",
                      field=path, valid=_type_name(tp))


def _to_tuple(value: Any, tp: Any, path: str) -> tuple[Any, ...]:
    """A list (or tuple) annotation: a YAML list, stored as a tuple (the dataclasses are frozen)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"expected a list, got {value!r}", field=path, valid=_type_name(tp))
    (item_tp,) = get_args(tp)[:1]
    return tuple(coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))


def _to_dict(value: Any, tp: Any, path: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"expected a mapping, got {value!r}", field=path, valid="mapping")
    key_tp, val_tp = get_args(tp)
    return {coerce(k, key_tp, path): coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}


def _to_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"expected true or false, got {value!r}", field=path, valid="true | false")


def _to_int(value: Any, path: str) -> int:
    """An int, or a float or numeric string with an integral value (`1e3`, `2.0`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, str) and _FLOAT_RE.match(value.strip()) and _float(value).is_integer():
        return int(_float(value))
    raise ConfigError(f"expected an integer, got {value!r}", field=path, valid="integer")


def _to_float(value: Any, path: str) -> float:
    """A finite number: an int or float, or a numeric string (YAML reads `5e-4` as a string)."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if not isinstance(value, int) or abs(value) < 2**1023 else math.inf
    elif isinstance(value, str) and _FLOAT_RE.match(value.strip()):
        number = _float(value)
    if number is not None and math.isfinite(number):
        return number
    raise ConfigError(f"expected a number, got {value!r}", field=path, valid="a finite number (e.g. 3e-4)")


def _to_str(value: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"expected a string, got {value!r}", field=path, valid="string")


# The annotation kinds `coerce` dispatches on: generic forms by `get_origin`, scalars by the type itself.
_BY_ORIGIN: dict[Any, Callable[[Any, Any, str], Any]] = {
    Union: _to_union, types.UnionType: _to_union, Literal: _to_literal,
    list: _to_tuple, tuple: _to_tuple, dict: _to_dict,
}
_SCALARS: dict[Any, Callable[[Any, str], Any]] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def build(cls: Any, data: Any, path: str = "") -> Any:
    """Construct dataclass `cls` from mapping `data`, rejecting unknown keys and missing required ones."""
    if path:
        return _build(cls, data, path)
    try:
        return _build(cls, data, path)
    except UnknownKeyError as e:  # from a section: now the whole schema is known, say where the key lives
        if e.has_root:
            raise
        raise UnknownKeyError(e.key, str(e.field), e.names, root=cls) from None


def _build(cls: Any, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping, got {data!r}", field=path or None,
                          valid="a mapping of sections (name, model, training, ...)")
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise UnknownKeyError(str(key), sub, fields, root=None if path else cls)
        kwargs[key] = coerce(value, hints[key], sub)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            sub = f"{path}.{name}" if path else name
            raise ConfigError("is required but not set", field=sub, valid=_type_name(hints[name]),
                              fix=f"add it to the recipe or pass --set {sub}=...")
    try:
        return cls(**kwargs)
    except ValueError as e:  # invariants checked in __post_init__
        raise ConfigError(str(e), field=path or None) from None


def to_plain(obj: Any) -> Any:
    """Dataclass -> nested dicts/lists (tuples become lists) for YAML/JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
