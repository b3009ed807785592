"""Validate `.bin/.idx` pairs thoroughly: header, index arrays consistent with each other and with
the `.bin` size, dtype able to hold the tokenizer's vocabulary, every token id inside it. Counts
tokens from the index, never from file sizes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megalaunch.data.index import DTYPES, IndexHeader, find_prefixes, read_index_header, split_prefix
from megalaunch.errors import PreflightError

_SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning ids (32-64 MB)


@dataclass
class PairReport:
    prefix: str
    dtype: str = "?"
    sequences: int = 0
    documents: int = 0
    tokens: int = 0
    bin_bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def expected_dtype(vocab_size: int) -> str:
    from megalaunch.data.writer import token_dtype_for_vocab

    return token_dtype_for_vocab(vocab_size)


def check_prefix(prefix: str, *, vocab_size: int | None = None, scan_ids: bool = True) -> PairReport:
    """Every check on one pair; problems are collected, not raised (see `raise_for_problems`)."""
    prefix = split_prefix(prefix)
    report = PairReport(prefix)
    has_idx, has_bin = os.path.isfile(prefix + ".idx"), os.path.isfile(prefix + ".bin")
    if not (has_idx and has_bin):
        missing = [s for s, ok in ((".idx", has_idx), (".bin", has_bin)) if not ok]
        report.problems.append(f"mismatched pair: {' and '.join(missing)} missing")
        return report
    try:
        header = read_index_header(prefix)
    except PreflightError as e:
        report.problems.append(e.message)
        return report
    report.dtype, report.sequences, report.documents = header.dtype, header.sequence_count, header.document_count
    report.tokens = header.token_count
    report.bin_bytes = os.path.getsize(prefix + ".bin")
    if header.version != 1:
        report.problems.append(f"index version {header.version}, expected 1")
    if header.dtype_code not in (1, 2, 3, 4, 5, 8):
        report.problems.append(f"dtype {header.dtype} is not a token type")
    _check_index_arrays(header, report)
    if report.bin_bytes != header.expected_bin_size:
        what = "truncated" if report.bin_bytes < header.expected_bin_size else "longer than its index"
        report.problems.append(f".bin is {what}: {report.bin_bytes} bytes, the index announces "
                               f"{header.expected_bin_size} ({header.token_count} {header.dtype} tokens)"
                               " — a truncated file or an .idx from another dataset")
    if vocab_size is not None:
        want = expected_dtype(vocab_size)
        if header.dtype != want:
            report.problems.append(f"dtype {header.dtype} does not match the vocabulary of {vocab_size} "
                                   f"tokens (expected {want})")
        elif scan_ids and report.ok and header.token_count:
            top = max_token_id(prefix, header)
            if top >= vocab_size:
                report.problems.append(f"token id {top} is outside the vocabulary of {vocab_size} tokens")
    return report


def _check_index_arrays(header: IndexHeader, report: PairReport) -> None:
    import numpy as np

    idx_bytes = os.path.getsize(header.path)
    multimodal = header.expected_idx_size + header.sequence_count
    if idx_bytes not in (header.expected_idx_size, multimodal):
        report.problems.append(f".idx is {idx_bytes} bytes, its header implies {header.expected_idx_size} "
                               "(truncated or corrupt index)")
        return
    if header.sequence_count == 0:
        return
    n, d = header.sequence_count, header.document_count
    sizes = np.memmap(header.path, dtype=np.int32, mode="r", offset=header.sizes_offset, shape=(n,))
    pointers = np.memmap(header.path, dtype=np.int64, mode="r", offset=header.pointers_offset, shape=(n,))
    docs = np.memmap(header.path, dtype=np.int64, mode="r", offset=header.document_indices_offset, shape=(d,))
    if (sizes < 0).any():
        report.problems.append("negative sequence sizes in the index")
        return
    expected = np.zeros(n, dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=expected[1:])
    if not np.array_equal(pointers, expected * header.itemsize):
        report.problems.append("sequence pointers do not follow the sizes (corrupt index)")
    if d == 0 or docs[0] != 0 or docs[-1] != n or (np.diff(docs) < 0).any():
        report.problems.append(f"document indices are not 0..{n} non-decreasing (corrupt index)")
    report.tokens = int(sizes.sum(dtype=np.int64))


def max_token_id(prefix: str, header: IndexHeader) -> int:
    import numpy as np

    tokens = np.memmap(prefix + ".bin", dtype=DTYPES[header.dtype_code][0], mode="r")
    top = 0
    for start in range(0, len(tokens), _SCAN_CHUNK):
        top = max(top, int(tokens[start:start + _SCAN_CHUNK].max()))
    return top


def check_paths(paths: list[str], *, vocab_size: int | None = None, scan_ids: bool = True) -> list[PairReport]:
    """Prefixes or directories (their pairs, sorted) -> one report per pair."""
    reports: list[PairReport] = []
    for path in paths:
        if os.path.isdir(path):
            prefixes = find_prefixes(path)
            if not prefixes:
                raise PreflightError(f"directory {path} holds no .bin/.idx files", field="data")
        else:
            prefixes = [split_prefix(path)]
        reports.extend(check_prefix(p, vocab_size=vocab_size, scan_ids=scan_ids) for p in prefixes)
    return reports


def raise_for_problems(reports: list[PairReport]) -> None:
    bad = [r for r in reports if not r.ok]
    if bad:
        first = bad[0]
        raise PreflightError(f"{first.prefix}: {first.problems[0]}"
                             + (f" (and {len(bad) - 1} more bad pairs)" if len(bad) > 1 else ""),
                             field="data", fix=f"megalaunch data check {os.path.dirname(first.prefix)}")
