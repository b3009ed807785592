"""The schema's string-typed fields, found by walking the dataclasses (so a field added later is covered
without touching the tests), and hypothesis strategies for hostile text."""

from __future__ import annotations

import dataclasses
import tempfile
import types
import typing
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from hypothesis import strategies as st

# A file that any interpreted payload below creates. It must never exist.
CANARY = Path(tempfile.gettempdir()) / f"megalaunch-canary-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class StringField:
    """One place a string goes: `path` is dotted (`cluster.env`), `kind` says how the string is set."""

    path: str
    kind: Literal["str", "literal", "list", "dict-value", "dict-key", "any-value"]

    def __str__(self) -> str:
        return f"{self.path}[{self.kind}]"


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def string_fields(cls: Any, prefix: str = "") -> list[StringField]:
    """Every field of dataclass `cls` (recursively) that holds text: str, Literal of strings,
    list[str], dict[str, str] (keys and values), dict[str, Any] values, and dataclasses inside lists."""
    out: list[StringField] = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = _strip_optional(hints[f.name])
        origin = get_origin(tp)
        if tp is str:
            out.append(StringField(path, "str"))
        elif origin is Literal and all(isinstance(a, str) for a in get_args(tp)):
            out.append(StringField(path, "literal"))
        elif origin in (list, tuple):
            (item,) = get_args(tp)[:1]
            item = _strip_optional(item)
            if item is str:
                out.append(StringField(path, "list"))
            elif dataclasses.is_dataclass(item):
                out += string_fields(item, f"{path}[0].")
        elif origin is dict:
            key_tp, val_tp = get_args(tp)
            if key_tp is str:
                out.append(StringField(path, "dict-key"))
            if val_tp is str:
                out.append(StringField(path, "dict-value"))
            elif val_tp is Any:
                out.append(StringField(path, "any-value"))
        elif dataclasses.is_dataclass(tp):
            out += string_fields(tp, f"{path}.")
    return out


# Key used when a field is a mapping: a valid name everywhere (environment variable, sbatch option,
# Megatron flag), so the value is what is under test.
DICT_KEY = "mlprop"


def override(field: StringField, text: str) -> dict[str, Any]:
    """The nested recipe mapping that puts `text` into `field`."""
    parts = field.path.split(".")
    leaf: Any
    if field.kind == "list":
        leaf = [text]
    elif field.kind in ("dict-value", "any-value"):
        leaf = {DICT_KEY: text}
    elif field.kind == "dict-key":
        leaf = {text: "x"}
    else:
        leaf = text
    tree: Any = leaf
    for part in reversed(parts):
        # a dataclass inside a list (data.blend[0].path) is one mapping in a list
        tree = {part[:-3]: [tree]} if part.endswith("[0]") else {part: tree}
    return typing.cast(dict[str, Any], tree)


def typed_value(field: StringField, recipe: Any, text: str) -> Any:
    """What the typed recipe holds where `field`'s text went (for a key: `text` if it is a key there)."""
    obj = recipe
    for part in field.path.split("."):
        obj = getattr(obj, part[:-3])[0] if part.endswith("[0]") else getattr(obj, part)
    if field.kind == "list":
        return obj[0]
    if field.kind in ("dict-value", "any-value"):
        return obj[DICT_KEY]
    if field.kind == "dict-key":
        return text if text in obj else None
    return obj


def merge(dst: dict[str, Any], src: dict[str, Any]) -> dict[str, Any]:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        else:
            dst[k] = v
    return dst


# -- hostile text ------------------------------------------------------------------------------
PAYLOADS = [
    f"$(/usr/bin/touch {CANARY})", f"`/usr/bin/touch {CANARY}`", f"';/usr/bin/touch {CANARY};'",
    f'";/usr/bin/touch {CANARY};"', f"\n/usr/bin/touch {CANARY}\n", f">{CANARY}", f"$(: >{CANARY})",
    f"x;: >{CANARY}", f"x&/usr/bin/touch {CANARY}", f"x|/usr/bin/touch {CANARY}", f"\\'$(: >{CANARY})",
    f"${{X:=$(: >{CANARY})}}", f"\r\n: >{CANARY}\r\n", f"%x\n: >{CANARY}",
]
FRAGMENTS = [
    "$(", ")", "`", "'", '"', ";", "&", "&&", "|", "||", "\n", "\r", "\r\n", "\0", "\\", "$", "${", "}",
    "$VAR", "$HOME", "${PATH}", "~", "~/", "~root", "-", "--", "-rf", "--help", "%", "%j", "%x", "%A", "%a",
    "%N", "%u", "%%", "#", "*", "?", "[", "]", "{run_dir}", "{", "<", ">", "!", " ", "\t", "é", "☃", "😀",
    "\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1e", "=", ",", ":", "/", "..", ".", "\ufeff", "\x7f",
    "a", "gpu", "0", "12:00:00", "/tmp", "x.y", "---", "...", "null", "true", "1e3", "0x10", "0o7", "010",
    "2024-01-01", "&a", "*a", "!!binary", "? ", ": ",
]
# Values most fields accept, so the rendered script is reached often.
PLAIN = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._/+-]{0,15}", fullmatch=True)

# What an anchored regular expression forgets: `$` also matches before a final newline.
ENDINGS = ["\n", "\r\n", "\0", " ", "\x85", "\u2028"]
_valid_then_bad = st.builds(str.__add__, PLAIN, st.sampled_from(ENDINGS))
hostile_text = st.one_of(
    PLAIN,
    _valid_then_bad, _valid_then_bad,
    st.builds(str.__add__, PLAIN, st.sampled_from(FRAGMENTS)),  # a valid value, then one bad character
    st.builds(str.__add__, st.sampled_from(FRAGMENTS), PLAIN),
    st.text(max_size=24),
    st.sampled_from(PAYLOADS),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.sampled_from(PAYLOADS), st.text(max_size=4)),
             min_size=1, max_size=6).map("".join),
)


def expected_text(field: StringField, text: str) -> str:
    """What the loader keeps of `text`: as written, except in path fields, where ~ and $VAR are
    expanded once with this environment (config/paths.py; container-side DSTs stay as written)."""
    from megalaunch.config.paths import _expand_mount, expand_path, path_fields
    from megalaunch.config.schema import Recipe

    name = field.path.replace("[0]", "[]")
    if field.kind not in ("str", "list") or name not in path_fields(Recipe):
        return text
    if name == "cluster.container.mounts":
        return _expand_mount(text, field.path, None)
    return expand_path(text, field.path)
