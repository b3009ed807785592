"""Data blends: sorted, weighted by token counts from the index, hashed, order-independent."""

from __future__ import annotations

import os

import pytest

from megalaunch.data.blend import Blend, resolve_blend
from megalaunch.data.index import read_index_header
from megalaunch.data.writer import write_dataset
from megalaunch.errors import ConfigError, PreflightError


def _folder(root, name, docs_per_file):
    folder = root / name
    folder.mkdir()
    for i, docs in enumerate(docs_per_file):
        write_dataset(folder / f"part_{i:02d}", docs)
    return folder


@pytest.fixture
def folders(tmp_path):
    a = _folder(tmp_path, "a", [[[1, 2, 3], [4]], [[5] * 10]])  # 4 and 10 tokens
    b = _folder(tmp_path, "b", [[[7, 8]], [[9] * 6, [1]], [[2] * 3]])  # 2, 7, 3 tokens
    (b / "sub").mkdir()
    write_dataset(b / "sub" / "deep", [[3] * 5])  # directories are searched recursively
    return a, b


def test_token_counts_come_from_the_index(folders):
    a, _ = folders
    header = read_index_header(a / "part_01")
    assert (header.token_count, header.sequence_count, header.document_count) == (10, 1, 2)
    assert header.dtype == "uint16"


def test_blend_weights_are_token_counts_sorted_by_prefix(folders):
    a, b = folders
    blend = resolve_blend([(str(b), None), (str(a), None)])
    assert [os.path.basename(os.path.dirname(p)) + "/" + os.path.basename(p) for p, _ in blend.prefixes] == [
        "a/part_00", "a/part_01", "b/part_00", "b/part_01", "b/part_02", "sub/deep"]
    assert [w for _, w in blend.prefixes] == [4, 10, 2, 7, 3, 5]
    assert blend.text == (f"4 {a}/part_00 10 {a}/part_01 2 {b}/part_00 7 {b}/part_01 3 {b}/part_02 "
                          f"5 {b}/sub/deep\n")
    blend.check_files()


def test_blend_is_identical_whatever_the_listing_or_file_system_order(folders, monkeypatch):
    a, b = folders
    first = resolve_blend([(str(a), None), (str(b), None)])
    second = resolve_blend([(str(b), None), (str(a), None)])
    real_scandir = os.scandir

    class Reversed:
        """os.scandir that yields entries in reverse name order (a file system with another order)."""

        def __init__(self, path):
            with real_scandir(path) as it:
                self._entries = iter(sorted(it, key=lambda e: e.name, reverse=True))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __iter__(self):
            return self

        def __next__(self):
            return next(self._entries)

        def close(self):
            pass

    monkeypatch.setattr(os, "scandir", Reversed)
    assert [e.name for e in os.scandir(a)] == ["part_01.idx", "part_01.bin", "part_00.idx", "part_00.bin"]
    third = resolve_blend([(str(b) + "/", None), (str(a), None)])
    assert first.text == second.text == third.text
    assert first.sha256 == second.sha256 == third.sha256


def test_given_weights_are_shared_within_a_directory_by_tokens(folders):
    a, b = folders
    blend = resolve_blend([(str(a), 0.8), (str(b / "part_01") + ".bin", 0.2)])  # a file names its prefix
    assert dict(blend.prefixes) == {f"{a}/part_00": pytest.approx(0.8 * 4 / 14),
                                    f"{a}/part_01": pytest.approx(0.8 * 10 / 14),
                                    f"{b}/part_01": 0.2}


def test_blend_round_trips_through_its_text(folders, tmp_path):
    blend = resolve_blend([(str(d), 1.5) for d in folders])
    blend.write(tmp_path / "data_blend.txt")
    again = Blend.read(tmp_path / "data_blend.txt")
    assert again.text == blend.text and again.sha256 == blend.sha256


def test_check_files_names_the_prefix_that_lost_a_file(folders):
    a, b = folders
    blend = resolve_blend([(str(a), None), (str(b), None)])
    os.unlink(f"{b}/part_01.bin")
    with pytest.raises(PreflightError, match=r"part_01\.bin is missing"):
        blend.check_files()


def test_check_files_catches_a_truncated_bin(folders):
    a, _ = folders
    blend = resolve_blend([(str(a), None)])
    os.truncate(f"{a}/part_01.bin", 6)
    with pytest.raises(PreflightError, match=r"part_01\.bin has 6 bytes"):
        blend.check_files()


def test_errors(folders, tmp_path):
    a, b = folders
    with pytest.raises(ConfigError, match="every blend entry has a weight or none"):
        resolve_blend([(str(a), 1.0), (str(b), None)])
    with pytest.raises(ConfigError, match="appears twice"):
        resolve_blend([(str(a), None), (str(a / "part_00"), None)])
    with pytest.raises(PreflightError, match="does not exist"):
        resolve_blend([(str(tmp_path / "nope"), None)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match=r"holds no \.bin/\.idx"):
        resolve_blend([(str(tmp_path / "empty"), None)])
    with pytest.raises(ConfigError, match="empty"):
        resolve_blend([])


def test_empty_datasets_are_left_out_and_reported(folders):
    a, _ = folders
    write_dataset(a / "part_99", [])
    blend = resolve_blend([(str(a), None)])
    assert blend.skipped_empty == (f"{a}/part_99",)
    assert len(blend.prefixes) == 2
