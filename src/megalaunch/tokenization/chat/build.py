"""`megalaunch data sft`: conversation files -> Megatron `.bin/.idx` token datasets, each with a
parallel loss mask `<prefix>.mask` (one byte per token: 1 where the token is an assistant's).

One output per input file (`OUT/<stem>.bin/.idx/.mask`), each written under temporary names and
renamed only when the whole file went through, then a completion marker `OUT/<stem>.done.json` with
its counts: a relaunch skips finished files (the same input, unchanged) and redoes the others, as
tokenization does. A file with malformed rows is refused with their row numbers and nothing of it
is written, unless `skip_malformed` is set; then the rows are left out, counted and listed in the
marker. Conversations are one document each: the dataset trains one per sequence (docs/finetuning.md)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from megalaunch.errors import PreflightError
from megalaunch.runtime.flows.chat_format import MARKER_SUFFIX, MASK_SUFFIX, tokenizer_digest
from megalaunch.tokenization.chat.render import ChatRenderer, Encoded, RenderError, fold_system
from megalaunch.tokenization.chat.rows import FORMATS, SUFFIXES, Row, read_rows

SHOWN_ROWS = 8  # malformed rows named in the one-line error (all of them go to the marker)


@dataclass
class FileStats:
    """What one input file gave."""

    input: str
    prefix: str = ""
    conversations: int = 0  # documents written (a preference pair writes two: chosen, then rejected)
    pairs: int = 0  # preference pairs (a file holds pairs or single conversations, never both)
    split_turns: int = 0  # conversations written one sample per assistant turn (tokenization/chat/render.py)
    folded_system: int = 0  # rows whose system message went into the first user turn (a template without one)
    tokens: int = 0
    trained_tokens: int = 0  # tokens under the loss mask
    longest: int = 0
    over_seq_length: int = 0  # conversations longer than seq_length + 1 tokens (truncated in training)
    malformed: list[dict[str, Any]] = field(default_factory=list)  # {"row": N, "problem": "..."}
    skipped: bool = False  # done by an earlier run
    identity: dict[str, int] = field(default_factory=dict)
    tokenizer_sha256: str | None = None  # of the tokenizer.json used (preflight compares the run's)


def input_files(inputs: list[str]) -> list[Path]:
    """The files named, directories expanded to their .jsonl/.json/.parquet files (sorted)."""
    out: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if path.is_dir():
            out += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        elif path.is_file():
            out.append(path)
        else:
            raise PreflightError(f"{raw} does not exist", field="inputs", fix="give conversation files or folders")
    if not out:
        raise PreflightError(f"no {'/'.join(SUFFIXES)} files in {' '.join(inputs)}", field="inputs",
                             valid=f"rows like {FORMATS}", fix="give conversation files or folders")
    stems = [_stem(p) for p in out]
    if len(set(stems)) != len(stems):
        dup = sorted({s for s in stems if stems.count(s) > 1})
        raise PreflightError(f"two inputs would write the same output {dup[0]!r}", field="inputs",
                             fix="rename one of them, or convert them in two runs with two --output folders")
    return out


def _stem(path: Path) -> str:
    return path.name[: -len(path.suffix)] if path.suffix else path.name


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def build(inputs: list[str], output: str | Path, *, tokenizer: str | Path, seq_length: int | None = None,
          skip_malformed: bool = False) -> list[FileStats]:
    """Convert every input file not done yet; returns the stats of all of them (done ones read back)."""
    files = input_files(inputs)
    out = Path(output).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    renderer: ChatRenderer | None = None
    results = []
    for path in files:
        prefix = out / _stem(path)
        done = _read_marker(prefix, path)
        if done is not None and done.tokenizer_sha256 == tokenizer_digest(tokenizer):
            results.append(done)
            continue
        renderer = renderer or ChatRenderer(tokenizer)
        results.append(convert_file(path, prefix, renderer, seq_length=seq_length, skip_malformed=skip_malformed))
    return results


def _read_marker(prefix: Path, path: Path) -> FileStats | None:
    marker = Path(str(prefix) + MARKER_SUFFIX)
    try:
        data = json.loads(marker.read_text())
        stats = FileStats(**data)
    except (OSError, ValueError, TypeError):
        return None
    if stats.identity != _identity(path) or not all(Path(str(prefix) + s).is_file() for s in (".bin", ".idx", MASK_SUFFIX)):
        return None
    stats.skipped = True
    return stats


def convert_file(path: Path, prefix: Path, renderer: ChatRenderer, *, seq_length: int | None,
                 skip_malformed: bool) -> FileStats:
    """One input file -> prefix.bin/.idx/.mask + marker, or nothing (an error naming the rows)."""
    from megalaunch.data.writer import IndexedWriter, token_dtype_for_vocab

    stats = FileStats(input=str(path), prefix=str(prefix), identity=_identity(path),
                      tokenizer_sha256=tokenizer_digest(renderer.source))
    Path(str(prefix) + MARKER_SUFFIX).unlink(missing_ok=True)  # being redone: not done any more
    writer = IndexedWriter(prefix, token_dtype_for_vocab(renderer.vocab_size))
    mask_tmp = Path(str(prefix) + MASK_SUFFIX + ".tmp")
    try:
        with open(mask_tmp, "wb") as mask_file:
            _encode_rows(path, renderer, writer, mask_file, stats, seq_length)
        if stats.malformed and not skip_malformed:
            raise _malformed_error(path, stats)
        if stats.conversations == 0:
            raise PreflightError(f"{path} holds no conversation", field="inputs", valid=f"rows like {FORMATS}",
                                 fix="give a file with at least one conversation")
        writer.close()
        os.replace(mask_tmp, str(prefix) + MASK_SUFFIX)
    except BaseException:
        writer.abort()
        for leftover in (f"{prefix}.bin.tmp", f"{prefix}.idx.tmp", mask_tmp):
            Path(leftover).unlink(missing_ok=True)
        raise
    marker = asdict(stats)
    marker.pop("skipped")
    tmp = Path(str(prefix) + MARKER_SUFFIX + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1) + "\n")
    os.replace(tmp, str(prefix) + MARKER_SUFFIX)
    return stats


def _encode_rows(path: Path, renderer: ChatRenderer, writer: Any, mask_file: Any, stats: FileStats,
                 seq_length: int | None) -> None:
    for row in read_rows(path):
        problem, encoded = row.problem, list[Encoded]()
        if problem is None and stats.conversations and (row.rejected is not None) != (stats.pairs > 0):
            problem = ("a preference pair in a file of conversations" if row.rejected is not None else
                       "a single conversation in a file of preference pairs") + "; keep them in separate files"
        try:
            if problem is None:
                encoded = _encode(renderer, row, stats)
        except RenderError as e:
            problem = str(e)
        if problem is not None:
            stats.malformed.append({"row": row.number, "problem": problem})
            continue
        stats.pairs += row.rejected is not None
        for enc in encoded:
            writer.add_batch([enc.tokens])
            mask_file.write(bytes(enc.mask))
            stats.conversations += 1
            stats.tokens += len(enc.tokens)
            stats.trained_tokens += sum(enc.mask)
            stats.longest = max(stats.longest, len(enc.tokens))
            stats.over_seq_length += seq_length is not None and len(enc.tokens) > seq_length + 1


def _encode(renderer: ChatRenderer, row: Row, stats: FileStats) -> list[Encoded]:
    """The row's samples; a conversation the template refuses for its system message is rendered with the
    system message folded into the first user turn (render.py's docstring: why), counted in the stats."""
    try:
        return _encode_as_is(renderer, row, stats)
    except RenderError as e:
        folded = [fold_system(m) if m is not None else None for m in (row.messages, row.rejected)]
        if folded[0] is None or (row.rejected is not None and folded[1] is None):
            raise
        try:
            out = _encode_as_is(renderer, replace(row, messages=folded[0], rejected=folded[1],
                                                  answer_from=max(row.answer_from - 1, 0)), stats)
        except RenderError as folded_error:
            raise RenderError(f"{e}; with the system message folded into the first user turn: {folded_error}") \
                from None
        stats.folded_system += 1
        return out


def _encode_as_is(renderer: ChatRenderer, row: Row, stats: FileStats) -> list[Encoded]:
    if row.rejected is None and row.messages is not None:
        encoded, split = renderer.encode_all(row.messages)
        stats.split_turns += split
        return encoded
    return [renderer.encode(m, row.answer_from) for m in (row.messages, row.rejected) if m is not None]


def _malformed_error(path: Path, stats: FileStats) -> PreflightError:
    bad = stats.malformed
    shown = "; ".join(f"row {b['row']}: {b['problem']}" for b in bad[:SHOWN_ROWS])
    more = f"; and {len(bad) - SHOWN_ROWS} more" if len(bad) > SHOWN_ROWS else ""
    return PreflightError(f"{path}: {len(bad)} malformed row{'s' if len(bad) > 1 else ''} ({shown}{more}); "
                          "nothing was written for this file", field="inputs", valid=f"rows like {FORMATS}",
                          fix="correct those rows, or pass --skip-malformed to leave them out (counted)")
