"""What travels to the login node with a command.

The recipe files, when they are files here: the recipe `submit` names, the recipe files it includes
(however deep) and a `--cluster` profile given as a file. They arrive in a private temporary
directory on the login node, under the same relative layout (so `include: ../base.yaml` still
finds its file) and are gone when the command ends: `submit` has written the resolved recipe into
the run directory by then. A shipped name (`tiny`, `clusters/slurm`) travels as a name and means the
login node's copy. Everything a recipe names as a path (data, blend files, checkpoints, tokenizers,
`--from-hf`) is a path on the cluster and travels as written; a relative one is relative to your
home directory there, where the command runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megalaunch.config.recipe_files import find_recipe, read_recipe_file, recipes_root
from megalaunch.errors import ConfigError, MegalaunchError

MAX_BYTES = 4 << 20  # recipes are small; a larger sum is a mistake (a data file named as a recipe)


@dataclass(frozen=True)
class Request:
    """The command to run there: its words, the files that travel (relative path -> text) and which
    words name one of them (index, the text before the path: '' or '--cluster=')."""

    argv: list[str]
    files: dict[str, str] = field(default_factory=dict)
    file_args: list[tuple[int, str]] = field(default_factory=list)
    via: str | None = None  # the host as the laptop named it: the login node's hints name it (`--host`)


@dataclass(frozen=True)
class Words:
    """Where things are in a command line: the command's index, its positional arguments' indices, and
    each value option's value index with the text before the value."""

    command: int
    positionals: list[int]
    options: dict[str, list[tuple[int, str]]]


def parse_words(argv: list[str], value_options: set[str]) -> Words | None:
    """The command and the indices of its arguments (None: no command). `value_options` are the
    command's options that take a value (from its own definition, so new options count)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # the root's own flags (--debug)
        i += 1
    if i == len(argv):
        return None
    words = Words(i, [], {})
    j = i + 1
    while j < len(argv):
        word = argv[j]
        if word == "--":
            words.positionals.extend(range(j + 1, len(argv)))
            break
        name, eq, _ = word.partition("=")
        if word.startswith("-") and eq and name in value_options:
            words.options.setdefault(name, []).append((j, name + "="))
        elif word in value_options and j + 1 < len(argv):
            words.options.setdefault(word, []).append((j + 1, ""))
            j += 1
        elif not word.startswith("-") or word == "-":
            words.positionals.append(j)
        j += 1
    return words


def _local_file(ref: str, relative_to: Path | None = None) -> Path | None:
    """The file `ref` names here, None for a shipped recipe or a name found nowhere here (the login
    node resolves it)."""
    try:
        path = find_recipe(ref, relative_to)
    except ConfigError:
        return None
    return None if path.is_relative_to(recipes_root().resolve()) else path


def _key(path: Path) -> str:
    return "files/" + str(path).lstrip("/")


def _ship(path: Path, files: dict[str, str]) -> None:
    """`path` and the local recipe files it includes, as relative path -> text; an include that would
    not find its file from the same layout there (absolute, ~, or found from the cwd) is rewritten
    relative to the including file."""
    key = _key(path)
    if key in files:
        return
    text = path.read_text(encoding="utf-8")
    files[key] = text
    data: Any = read_recipe_file(path)
    includes = data.get("include") or []
    includes = [includes] if isinstance(includes, str) else includes
    if not isinstance(includes, list):
        return  # the login node names the error
    rewritten, changed = [], False
    for inc in includes:
        found = _local_file(inc, path.parent) if isinstance(inc, str) else None
        if found is None:
            rewritten.append(inc)
            continue
        _ship(found, files)
        same = not Path(inc).is_absolute() and not inc.startswith("~") and (path.parent / inc).resolve() in (
            found, found.with_suffix(".yaml"))
        rel = inc if same else os.path.relpath(found, path.parent)
        changed |= rel != inc
        rewritten.append(rel)
    if changed:
        files[key] = yaml.safe_dump({**data, "include": rewritten}, sort_keys=False)


def build_request(argv: list[str], value_options: set[str]) -> Request:
    """The request for `argv`: for `submit`, its recipe and `--cluster` profile travel when they are
    files here; other commands travel as they are."""
    words = parse_words(argv, value_options)
    if words is None or argv[words.command] != "submit":
        return Request(list(argv))
    out, files, file_args = list(argv), dict[str, str](), list[tuple[int, str]]()
    named = [(i, "", argv[i]) for i in words.positionals[:1]]
    for index, prefix in words.options.get("--cluster", []):
        ref = argv[index][len(prefix):]
        named.append((index, prefix, ref if "/" in ref or ref.endswith(".yaml") else f"clusters/{ref}"))
    for index, prefix, ref in named:
        path = _local_file(ref)
        if path is None:
            continue
        try:
            _ship(path, files)
        except OSError as e:
            raise ConfigError(f"cannot read recipe {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"recipe {path} is not UTF-8 text", fix="give a YAML recipe file") from None
        out[index] = prefix + _key(path)
        file_args.append((index, prefix))
    if sum(len(t.encode()) for t in files.values()) > MAX_BYTES:
        raise MegalaunchError(f"the recipe files to send are over {MAX_BYTES >> 20} MiB: is a data file named "
                              "as a recipe or include?", fix="name recipe YAML files only; data stays on the cluster")
    return Request(out, files, file_args)
