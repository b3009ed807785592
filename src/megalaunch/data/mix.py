"""Data mixtures, two ways (users choose):

* `links` (swiss-ai semantics): a folder of symbolic links to whole `.bin/.idx` pairs, picked without
  repetition in a seeded shuffled order per source, until the source that limits the ratios is
  exhausted. Shares are measured in tokens (from the `.idx`), not bytes. Training then reads the folder with weights = token counts.
* `blend` (Megatron's semantics): every pair of every source, with the sources' weights spread over
  their pairs; Megatron samples with repetition, so small sources are repeated to reach their share.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.data.index import find_prefixes, read_index_header
from megalaunch.errors import ConfigError, PreflightError

SEED = 1234


@dataclass(frozen=True)
class Source:
    folder: str
    name: str  # subfolder of the mixture
    weight: float  # normalized
    available: tuple[tuple[str, int], ...]  # (prefix, tokens), sorted
    chosen: tuple[tuple[str, int], ...]  # (prefix, tokens), in pick order

    @property
    def tokens_available(self) -> int:
        return sum(t for _, t in self.available)

    @property
    def tokens_chosen(self) -> int:
        return sum(t for _, t in self.chosen)


@dataclass(frozen=True)
class Mixture:
    sources: tuple[Source, ...]
    mode: str  # links | blend

    @property
    def tokens(self) -> int:
        return sum(s.tokens_chosen for s in self.sources)

    def share(self, source: Source) -> float:
        return source.tokens_chosen / self.tokens if self.tokens else 0.0

    def report_rows(self) -> list[dict[str, Any]]:
        rows = []
        for s in self.sources:
            size = sum(os.path.getsize(p + ".bin") for p, _ in s.chosen)
            rows.append({"source": s.folder, "name": s.name, "weight": round(s.weight, 6),
                         "prefixes": len(s.chosen), "prefixes_available": len(s.available),
                         "tokens": s.tokens_chosen, "tokens_available": s.tokens_available,
                         "share": round(self.share(s), 6), "bin_bytes": size})
        return rows


def _normalize(folders: list[str], weights: list[float]) -> list[float]:
    if len(folders) != len(weights):
        raise ConfigError(f"{len(folders)} folders but {len(weights)} weights", field="--weights",
                          fix="give one weight per folder")
    if not folders:
        raise ConfigError("no folders given", field="--folders")
    if any(not w > 0 for w in weights):
        raise ConfigError(f"weights must be positive, got {weights}", field="--weights")
    total = sum(weights)
    return [w / total for w in weights]


def _names(folders: list[str]) -> list[str]:
    names: list[str] = []
    for folder in folders:
        base = os.path.basename(os.path.normpath(folder)) or "source"
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def _available(folder: str) -> tuple[tuple[str, int], ...]:
    if not os.path.isdir(folder):
        raise PreflightError(f"{folder} is not a directory", field="--folders")
    prefixes = find_prefixes(folder)
    if not prefixes:
        raise PreflightError(f"{folder} holds no .bin/.idx files", field="--folders")
    pairs = []
    for p in prefixes:
        if not os.path.isfile(p + ".bin"):
            raise PreflightError(f"{p}.bin is missing (its .idx exists)", field="--folders",
                                 fix=f"megalaunch data check {folder}")
        tokens = read_index_header(p).token_count
        if tokens:
            pairs.append((p, tokens))
    if not pairs:
        raise PreflightError(f"{folder} holds only empty datasets", field="--folders")
    return tuple(pairs)


def plan_mixture(folders: list[str], weights: list[float], *, mode: str = "links", seed: int = SEED) -> Mixture:
    """Choose the pairs of each source (all of them in `blend` mode)."""
    if mode not in ("links", "blend"):
        raise ConfigError(f"unknown mixture mode {mode!r}", field="--mode", valid="links | blend")
    folders = [os.path.abspath(os.path.expanduser(f)) for f in folders]
    if len(set(folders)) != len(folders):
        raise ConfigError("a folder is listed twice", field="--folders")
    norm = _normalize(folders, weights)
    available = [_available(f) for f in folders]
    if mode == "blend":
        chosen = [list(a) for a in available]
    else:
        chosen = _pick_without_repetition(norm, available, seed)
    return Mixture(sources=tuple(Source(f, n, w, a, tuple(c)) for f, n, w, a, c
                                 in zip(folders, _names(folders), norm, available, chosen, strict=True)),
                   mode=mode)


def _pick_without_repetition(weights: list[float], available: list[tuple[tuple[str, int], ...]],
                             seed: int) -> list[list[tuple[str, int]]]:
    """The limiting source (least tokens per unit of weight) is used whole; every other source gets
    its share of that total, taking its pairs in a seeded shuffled order while each pair brings it
    closer to its target. Pairs are never repeated."""
    tokens = [sum(t for _, t in pairs) for pairs in available]
    total = min(t / w for t, w in zip(tokens, weights, strict=True))
    chosen: list[list[tuple[str, int]]] = []
    for pairs, weight in zip(available, weights, strict=True):
        order = list(pairs)  # sorted by prefix: the file system's order never matters
        random.Random(seed).shuffle(order)
        target = weight * total
        taken: list[tuple[str, int]] = []
        got = 0
        for pair in order:
            if abs(got + pair[1] - target) >= abs(got - target):
                break
            taken.append(pair)
            got += pair[1]
        chosen.append(taken)
    return chosen


def write_mixture(mixture: Mixture, output: str | os.PathLike[str]) -> Path:
    """`links`: OUTPUT/<source>/<path inside the source>.{bin,idx} links. `blend`: OUTPUT/data_blend.txt.
    Both: OUTPUT/mixture.json (the report). Refuses a non-empty OUTPUT that is not this mixture."""
    from megalaunch.rundir.files import atomic_write_json

    out = Path(output).expanduser().absolute()
    report = {"mode": mixture.mode, "tokens": mixture.tokens, "sources": mixture.report_rows()}
    if out.exists() and any(out.iterdir()):
        old = out / "mixture.json"
        if not old.is_file() or json.loads(old.read_text()) != report:
            raise PreflightError(f"{out} exists and holds something else", field="--output",
                                 fix="choose a new output folder (mixtures are immutable once used)")
        return out
    out.mkdir(parents=True, exist_ok=True)
    if mixture.mode == "links":
        for source in mixture.sources:
            for prefix, _ in source.chosen:
                link = out / source.name / os.path.relpath(prefix, source.folder)
                link.parent.mkdir(parents=True, exist_ok=True)
                for suffix in (".bin", ".idx"):
                    os.symlink(prefix + suffix, str(link) + suffix)
    else:
        from megalaunch.data.blend import resolve_blend

        resolve_blend([(s.folder, s.weight) for s in mixture.sources]).write(out / "data_blend.txt")
    atomic_write_json(out / "mixture.json", report)
    return out


def format_report(mixture: Mixture, train_tokens: int | None = None) -> str:
    """The report table (one row per source, then the total)."""
    head = f"{'source':24}{'weight':>8}{'share':>8}{'prefixes':>11}{'tokens':>16}{'of available':>14}{'size':>11}"
    if train_tokens:
        head += f"{'epochs':>8}"
    lines = [head]
    for row, source in zip(mixture.report_rows(), mixture.sources, strict=True):
        share = row["weight"] if mixture.mode == "blend" else row["share"]
        line = (f"{str(row['name'])[:23]:24}{row['weight']:>8.3f}{share:>8.3f}"
                f"{f'{row['prefixes']}/{row['prefixes_available']}':>11}{row['tokens']:>16,}"
                f"{source.tokens_chosen / max(1, source.tokens_available):>14.1%}{_size(int(row['bin_bytes'])):>11}")
        if train_tokens:
            line += f"{train_tokens * float(share) / max(1, source.tokens_chosen):>8.2f}"
        lines.append(line)
    lines.append(f"{'total':24}{'':16}{sum(len(s.chosen) for s in mixture.sources):>11}{mixture.tokens:>16,}")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"
