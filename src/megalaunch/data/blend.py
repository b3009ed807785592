"""Data blends: resolve prefixes once, weight them, hash them, freeze them.

`resolve_blend([(path, weight_or_None), ...])` expands directories to the sorted `.bin/.idx`
prefixes inside them, weights each prefix by its token count (read from the `.idx`) unless weights
are given, sorts everything by prefix and returns a `Blend` whose `.text` is Megatron's
`--data-args-path` content. Listing order and file-system order never change the result."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megalaunch.data.index import find_prefixes, read_index_header, split_prefix
from megalaunch.errors import ConfigError, PreflightError


@dataclass(frozen=True)
class Blend:
    """Sorted `(prefix, weight)` pairs. `skipped_empty` lists prefixes left out because their index
    holds no tokens (Megatron cannot sample from an empty dataset)."""

    prefixes: tuple[tuple[str, float], ...]
    skipped_empty: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """`weight prefix weight prefix ...` on one line: Megatron's `--data-args-path` file."""
        return " ".join(f"{format_weight(w)} {p}" for p, w in self.prefixes) + "\n"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def check_files(self) -> None:
        """Every prefix has a `.bin` and an `.idx`, and the `.bin` holds exactly the bytes the index
        announces (a cheap stat; `megalaunch data check` does the thorough check)."""
        for prefix, _ in self.prefixes:
            for suffix in (".idx", ".bin"):
                if not os.path.isfile(prefix + suffix):
                    raise PreflightError(f"{prefix}{suffix} is missing", field="data",
                                         fix=f"re-run the tokenization that wrote {prefix}, or drop it "
                                             "from the blend")
            header = read_index_header(prefix)
            size = os.path.getsize(prefix + ".bin")
            if size != header.expected_bin_size:
                raise PreflightError(f"{prefix}.bin has {size} bytes but its index announces "
                                     f"{header.expected_bin_size} ({header.token_count} {header.dtype} tokens)",
                                     field="data", fix=f"megalaunch data check {prefix}")

    def write(self, path: str | os.PathLike[str]) -> None:
        from megalaunch.rundir.files import atomic_write_text

        atomic_write_text(path, self.text)

    @classmethod
    def from_text(cls, text: str) -> Blend:
        """Parse a `--data-args-path` file written by `.text` (or by hand: `weight prefix ...`)."""
        words = text.split()
        if len(words) % 2:
            raise ConfigError("a data blend needs `weight prefix` pairs; got an odd number of words",
                              field="data_blend")
        pairs = []
        for i in range(0, len(words), 2):
            try:
                weight = float(words[i])
            except ValueError:
                raise ConfigError(f"weight {words[i]!r} before {words[i + 1]} is not a number",
                                  field="data_blend") from None
            pairs.append((words[i + 1], weight))
        return cls(prefixes=tuple(pairs))

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Blend:
        return cls.from_text(Path(path).read_text())


def format_weight(weight: float) -> str:
    """Integers without a decimal point, other floats in their shortest round-trip form."""
    return str(int(weight)) if float(weight).is_integer() else repr(float(weight))


def resolve_blend(entries: Sequence[tuple[str, float | None]]) -> Blend:
    """Resolve `(prefix-or-directory, weight-or-None)` entries into a frozen, sorted Blend.

    Without weights every prefix weighs its token count. With weights (all entries must have one),
    a directory's weight is shared among its prefixes in proportion to their token counts."""
    if not entries:
        raise ConfigError("the data blend is empty", field="data", fix="name at least one prefix or directory")
    given = [w is not None for _, w in entries]
    if any(given) and not all(given):
        raise ConfigError("either every blend entry has a weight or none has",
                          field="data", valid="all weights, or none (weights = token counts)")
    weighted: dict[str, float] = {}
    skipped: list[str] = []
    for raw, weight in entries:
        if weight is not None and not weight > 0:
            raise ConfigError(f"weight {weight} for {raw} must be positive", field="data")
        counts = _token_counts(_expand(raw))
        total = sum(counts.values())
        if total == 0:
            raise PreflightError(f"{raw} holds no tokens (every index is empty)", field="data",
                                 fix=f"megalaunch data check {raw}")
        for prefix, tokens in counts.items():
            if tokens == 0:
                skipped.append(prefix)
                continue
            if prefix in weighted:
                raise ConfigError(f"{prefix} appears twice in the blend", field="data",
                                  fix="list each prefix or directory once")
            weighted[prefix] = float(tokens) if weight is None else weight * tokens / total
    return Blend(prefixes=tuple(sorted(weighted.items())), skipped_empty=tuple(sorted(skipped)))


def load_blend_file(path: str | os.PathLike[str], field: str = "data.blend_file") -> Blend:
    """A blend file (`megalaunch data blend --output`, or written by hand): `weight prefix ...` pairs,
    prefixes relative to the file's directory made absolute, sorted by prefix as `resolve_blend` sorts
    them, so the file `data blend` wrote comes back byte for byte."""
    file = Path(os.path.abspath(os.path.expanduser(path)))
    fix = "write one with `megalaunch data blend DIR... --output FILE`"
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = "does not exist" if isinstance(e, FileNotFoundError) else "cannot be read"
        raise PreflightError(f"{file} {reason}", field=field, fix=fix) from None
    try:
        parsed = Blend.from_text(text)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e.message}", field=field, valid="`weight prefix weight prefix ...`",
                          fix=fix) from None
    weighted: dict[str, float] = {}
    for prefix, weight in parsed.prefixes:
        prefix = os.path.normpath(os.path.join(file.parent, prefix))
        if not weight > 0:
            raise ConfigError(f"{file}: weight {weight} for {prefix} must be positive", field=field, fix=fix)
        if prefix in weighted:
            raise ConfigError(f"{file}: {prefix} appears twice", field=field, fix=fix)
        weighted[prefix] = weight
    if not weighted:
        raise ConfigError(f"{file} names no prefix", field=field, fix=fix)
    return Blend(prefixes=tuple(sorted(weighted.items())))


def tokenization_output(path: str) -> str | None:
    """The output folder of a tokenization run directory (`megalaunch tokenize plan --run-dir`), or None
    when `path` is not one. Refuses a run whose dumps are not all done: its outputs are still growing."""
    from megalaunch.rundir.tokenize import TokenizeRun

    run = TokenizeRun(Path(path))
    if not (run.plan_json.is_file() and run.recipe_yaml.is_file()):
        return None
    import json

    import yaml

    try:
        dumps = [int(d["index"]) for d in json.loads(run.plan_json.read_text())["dumps"]]
        recipe = yaml.safe_load(run.recipe_yaml.read_text()) or {}
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        raise PreflightError(f"tokenization run {path}: plan.json or recipe.yaml is unreadable", field="data",
                             fix=f"megalaunch tokenize status {path}") from None
    missing = [d for d in dumps if not run.summary(d).is_file()]
    if missing:
        raise PreflightError(f"tokenization run {path} is not finished: {len(dumps) - len(missing)} of {len(dumps)} "
                             "dumps done", field="data",
                             fix=f"megalaunch tokenize submit {path} (resumes), then megalaunch tokenize status {path}")
    output = recipe.get("output_dir") if isinstance(recipe, dict) else None
    return str(run.output_dir(output if isinstance(output, str) else ""))


def _expand(raw: str) -> list[str]:
    path = os.path.abspath(os.path.expanduser(raw))
    if os.path.isdir(path):
        path = tokenization_output(path) or path
        prefixes = find_prefixes(path)
        if not prefixes:
            raise PreflightError(f"directory {path} holds no .bin/.idx files", field="data",
                                 fix="point at the tokenization output folder, or tokenize first")
    else:
        prefixes = [split_prefix(path)]
    for prefix in prefixes:
        if any(c.isspace() for c in prefix):
            raise PreflightError(f"prefix {prefix!r} contains whitespace, which Megatron's data-args file "
                                 "cannot represent", field="data", fix="rename or link the files")
    return prefixes


def _token_counts(prefixes: Iterable[str]) -> dict[str, int]:
    return {p: read_index_header(p).token_count for p in prefixes}
