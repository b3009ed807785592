"""`data check`: truncated .bin, swapped .idx, dtype/vocabulary mismatch, mismatched pairs, and a
round trip through Megatron's own IndexedDataset."""

from __future__ import annotations

import os
import shutil
import struct

import pytest

from megalaunch.data.check import check_paths, check_prefix, raise_for_problems
from megalaunch.data.index import read_documents, read_index_header
from megalaunch.data.writer import IndexedWriter, write_dataset
from megalaunch.errors import PreflightError

DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest.fixture
def pair(tmp_path):
    write_dataset(tmp_path / "a", DOCS)
    return str(tmp_path / "a")


def test_a_good_pair_passes_and_counts_tokens_from_the_index(pair):
    report = check_prefix(pair, vocab_size=500)
    assert report.ok, report.problems
    assert (report.dtype, report.sequences, report.documents, report.tokens) == ("uint16", 4, 5, 10)
    assert [list(map(int, d)) for d in read_documents(pair)] == DOCS


def test_truncated_bin(pair):
    os.truncate(pair + ".bin", 12)
    report = check_prefix(pair)
    assert not report.ok and "truncated" in report.problems[0]
    with pytest.raises(PreflightError, match="truncated"):
        raise_for_problems([report])


def test_swapped_idx(pair, tmp_path):
    write_dataset(tmp_path / "b", [[1] * 7, [2] * 9])
    shutil.copy(tmp_path / "b.idx", pair + ".idx")  # an index from another dataset
    report = check_prefix(pair)
    assert not report.ok and "another dataset" in report.problems[0]


def test_truncated_idx(pair):
    os.truncate(pair + ".idx", os.path.getsize(pair + ".idx") - 8)
    assert "truncated or corrupt index" in check_prefix(pair).problems[0]


def test_corrupt_pointers(pair):
    header = read_index_header(pair)
    with open(pair + ".idx", "r+b") as f:
        f.seek(header.pointers_offset + 8)
        f.write(struct.pack("<q", 99))
    assert any("pointers" in p for p in check_prefix(pair).problems)


def test_dtype_vocabulary_mismatch(tmp_path, pair):
    # uint16 cannot hold a 100k vocabulary
    assert "expected int32" in check_prefix(pair, vocab_size=100_000).problems[0]
    # int32 tokens for a 500-token vocabulary: not what the tokenizer implies
    write_dataset(tmp_path / "wide", DOCS, dtype="int32")
    assert "expected uint16" in check_prefix(str(tmp_path / "wide"), vocab_size=500).problems[0]
    # ids beyond the vocabulary (the data was tokenized with another tokenizer)
    assert "outside the vocabulary" in check_prefix(pair, vocab_size=8).problems[0]
    assert check_prefix(pair, vocab_size=8, scan_ids=False).ok


def test_mismatched_pairs_and_bad_magic(tmp_path, pair):
    os.unlink(pair + ".bin")
    write_dataset(tmp_path / "c", DOCS)
    os.unlink(tmp_path / "c.idx")
    (tmp_path / "d.idx").write_bytes(b"NOTANIDX" * 8)
    (tmp_path / "d.bin").write_bytes(b"")
    reports = {os.path.basename(r.prefix): r for r in check_paths([str(tmp_path)])}
    assert "mismatched pair: .bin missing" in reports["a"].problems[0]
    assert "mismatched pair: .idx missing" in reports["c"].problems[0]
    assert "not a Megatron index" in reports["d"].problems[0]


def test_empty_dataset_is_valid(tmp_path):
    write_dataset(tmp_path / "e", [])
    report = check_prefix(str(tmp_path / "e"), vocab_size=500)
    assert report.ok and report.tokens == 0 and report.documents == 1


def test_writer_leaves_no_pair_when_interrupted(tmp_path):
    with pytest.raises(RuntimeError), IndexedWriter(tmp_path / "x") as w:
        w.add_batch([[1, 2]])
        raise RuntimeError("killed")
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.megatron
def test_megatron_reads_our_files_bit_exactly(tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = [[i % 500 for i in range(n, n + 3 * n + 1)] for n in range(1, 40)]
    write_dataset(tmp_path / "m", docs)
    ds = indexed.IndexedDataset(str(tmp_path / "m"))
    assert len(ds) == len(docs)
    assert [list(map(int, ds[i])) for i in range(len(ds))] == docs
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    assert read_index_header(tmp_path / "m").token_count == sum(map(len, docs)) == int(ds.sequence_lengths.sum())
