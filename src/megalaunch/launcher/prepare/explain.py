"""YAML with provenance comments: `run.yaml` and `megalaunch recipes show --explain`."""

from __future__ import annotations

import re
from typing import Any

import yaml
import yaml.resolver


def _dump(value: Any, **style: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, **style).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    elif text.endswith("..."):
        text = text[:-3].strip()
    return text


# A string of these characters, starting with a letter, digit or `_`, is one that PyYAML writes as it is
# (a plain scalar) whenever its resolver reads it back as a string: most keys and values of run.yaml.
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*\Z")
_RESOLVER = yaml.resolver.Resolver()
_STR_TAG = "tag:yaml.org,2002:str"


def _scalar(value: Any) -> str:
    """`value` as YAML on one line that reads back as `value`: what `_scalar_dumped` writes, without
    PyYAML's emitter and parser for the common cases (`run.yaml` has ~175 leaves; those two were ~90 % of
    `prepare_run`). tests/unit/test_explain.py holds the two to the same text."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is int:
        return str(value)
    if (type(value) is str and _PLAIN.match(value)
            and _RESOLVER.resolve(yaml.ScalarNode, value, (True, False)) == _STR_TAG):
        return value
    return _scalar_dumped(value)


def _scalar_dumped(value: Any) -> str:
    """`value` as YAML on one line that reads back as `value`. PyYAML's readable style can break a
    string over lines (not allowed for a key) or write U+0085, U+2028 or U+2029 raw, which a parser reads
    as a line break (alone it reads back; as a key before `: ` it breaks the mapping): then every character
    is escaped inside double quotes."""
    text = _dump(value, allow_unicode=True)
    if any(c in text for c in "\n\x85\u2028\u2029") or yaml.safe_load(text) != value:
        text = _dump(value, allow_unicode=False, default_style='"')
    return text


def yaml_with_origins(data: dict[str, Any], origin: Any, prefix: str = "", indent: int = 0) -> str:
    """Block YAML of `data` where each leaf carries `# <origin(dotted)>` unless it is a default."""
    lines: list[str] = []
    pad = "  " * indent
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{_scalar(key)}:")
            lines.append(yaml_with_origins(value, origin, dotted + ".", indent + 1).rstrip("\n"))
            continue
        src = origin(dotted)
        note = f"  # {src}" if src != "default" else ""
        lines.append(f"{pad}{_scalar(key)}: {_scalar(value)}{note}")
    return "\n".join(lines) + "\n"


def origins_from(text: str, data: dict[str, Any]) -> dict[str, str]:
    """The inverse of `yaml_with_origins`' comments: dotted leaf -> origin, read from `text` (a run.yaml)
    whose data is `data`. The lines are rebuilt without comments and matched in order, so a value
    that holds `#` cannot be mistaken for a comment."""
    bare = yaml_with_origins(data, lambda _: "default").splitlines()
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    leaves = list(_leaves(data))
    out: dict[str, str] = {}
    if len(lines) != len(bare):
        return out
    leaf_iter = iter(leaves)
    for line, plain in zip(lines, bare, strict=True):
        if plain.endswith(":") and line == plain:
            continue  # a section header
        dotted = next(leaf_iter, None)
        if dotted is not None and line.startswith(plain) and line[len(plain):].startswith("  # "):
            out[dotted] = line[len(plain) + 4:]
    return out


def _leaves(data: dict[str, Any], prefix: str = "") -> Any:
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"
