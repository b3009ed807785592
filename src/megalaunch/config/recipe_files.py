"""Recipe files: where the shipped recipes are, which file a name or a path means, and one file read
strictly: YAML with no key repeated in a mapping and no alias inside itself, and nothing that is empty,
binary or not a mapping at the top. Composing files into a recipe is config/loader.py's.

Provenance and error messages name a file by `display_name` (a shipped one as `recipes/GROUP/NAME.yaml`);
`base_dir` is where its relative paths start."""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from megalaunch.config.typed import did_you_mean
from megalaunch.errors import ConfigError

RECIPE_GROUPS = ("train", "models", "clusters", "training", "tokenize")


def recipes_root() -> Path:
    return Path(str(resources.files("megalaunch") / "recipes"))


def shipped_recipes() -> dict[str, Path]:
    """'group/name' -> file, for every shipped recipe."""
    return dict(_shipped())


@functools.cache
def _shipped() -> dict[str, Path]:  # the package's own files: listed once per process (a load asks ~6 times)
    root = recipes_root()
    out = {}
    for group in RECIPE_GROUPS:
        for p in sorted((root / group).glob("*.yaml")):
            out[f"{group}/{p.stem}"] = p
    return out


def find_recipe(ref: str, relative_to: Path | None = None, group: str = "train") -> Path:
    """A file path (absolute, or relative to the including file / cwd) or a shipped name
    ('train/tiny', or just 'tiny' for a recipe of `group`)."""
    candidates = []
    p = Path(os.path.expanduser(ref))  # Path.expanduser raises for an unknown ~user
    if relative_to is not None and not p.is_absolute():
        candidates.append(relative_to / p)
    candidates.append(p)
    for c in candidates:
        if c.is_file():
            return c.resolve()

        if c.suffix == "" and c.with_suffix(".yaml").is_file():
            return c.with_suffix(".yaml").resolve()
    shipped = shipped_recipes()
    name = ref[:-5] if ref.endswith(".yaml") else ref
    for key in (name, f"{group}/{name}"):
        if key in shipped:
            return shipped[key]
    if any(c.is_dir() for c in candidates):
        raise ConfigError(f"{ref} is a directory, not a recipe file", fix="name a .yaml file in it")
    raise ConfigError(f"recipe '{ref}' not found{did_you_mean(name, shipped)}",
                      valid="a YAML file path or a shipped recipe (see `megalaunch recipes list`)")


def display_name(path: Path) -> str:
    """How provenance and errors name a recipe file: a shipped one under `recipes/`, others by path."""
    root = recipes_root()
    try:
        return "recipes/" + str(path.relative_to(root))
    except ValueError:
        return str(path)


def base_dir(path: Path) -> Path:
    """Relative paths in a recipe file are relative to the file; in a shipped recipe, to the cwd."""
    return Path.cwd() if path.resolve().is_relative_to(recipes_root().resolve()) else path.parent


# libyaml's parser where PyYAML was built with it (~10x faster: a run's run.yaml is read by every `status`)
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_SAFE_LOADER):  # type: ignore[misc, valid-type]
    """YAML's safe loader, refusing a key repeated in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                    "the second would silently replace the first", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, where: str) -> Any:
    """`yaml.load` that refuses what it would build but Python cannot handle: an alias inside itself
    (`&a [*a]`, endless recursion later). A scalar Python cannot build (the date 2024-13-45, an integer
    of 5000 digits) raises ValueError for the caller to report."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply", fix="write the value with fewer nested brackets") from None
    except (AttributeError, TypeError, IndexError, KeyError) as e:  # PyYAML's own constructors: `!!timestamp x`, `!!float`
        raise ValueError(str(e)) from None
    stack: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, (dict, list)):
            if id(node) in stack:
                raise ConfigError(f"{where}: a YAML alias refers to a mapping or list that contains it",
                                  fix="write the value out instead of the alias")
            stack.add(id(node))
            for child in (node.values() if isinstance(node, dict) else node):
                walk(child)
            stack.discard(id(node))

    walk(data)
    return data


def parse_yaml(text: str, where: str) -> Any:
    """YAML with duplicate keys refused; errors name `where` and the line."""
    try:
        return load_yaml(text, where)
    except ValueError as e:  # a scalar YAML recognises but Python cannot build
        raise ConfigError(f"{where}: a value cannot be read ({e})", fix="quote it to make it a string") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(e, "problem", None) or e
        if isinstance(e, yaml.constructor.ConstructorError):  # a repeated key
            raise ConfigError(f"{where}:{line} {problem}") from None
        raise ConfigError(f"{where}:{line} is not valid YAML ({problem})") from None


def read_recipe_file(path: Path) -> dict[str, Any]:
    """One recipe file's top-level mapping (`{}` when its YAML holds nothing), or a ConfigError naming it."""
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a recipe file", fix="name a .yaml file in it")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read recipe {path}: {e.strerror}") from None
    if not raw.strip():
        raise ConfigError(f"{path} is empty: a recipe needs at least `name:` and an `include:` or sections",
                          fix="see `megalaunch recipes show tiny` for a complete one")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): not a recipe file") from None
    if "\0" in text:
        raise ConfigError(f"{path} holds NUL bytes: not a recipe file")
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping at the top level, got {type(data).__name__}")
    return data
