"""Checkpoint read-ahead (runtime/checkpoint/readahead.py): what it reads, and when it stays off."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megalaunch.runtime.checkpoint import readahead


def _checkpoint(tmp_path: Path) -> tuple[Path, int]:
    d = tmp_path / "iter_0000020"
    (d / "sub").mkdir(parents=True)
    sizes = {"__0_0.distcp": 3 * readahead.CHUNK + 5, "__0_1.distcp": 1000, "sub/common.pt": 10, ".metadata": 0}
    for name, size in sizes.items():
        (d / name).write_bytes(b"\1" * size)
    return d, sum(sizes.values())


def _wait(reader: readahead.ReadAhead) -> dict:
    reader.thread.join(30)
    return reader.figures()


def test_reads_every_byte_of_the_checkpoint_once(tmp_path: Path) -> None:
    d, total = _checkpoint(tmp_path)
    reader, why = readahead.start(d, local_rank=0, nodes=1)
    assert reader is not None and why.startswith("reading iter_0000020 (")
    figures = _wait(reader)
    assert (figures["bytes"], figures["read_bytes"], figures["done"]) == (total, total, True)
    assert "error" not in figures and figures["seconds"] >= 0


@pytest.mark.parametrize(("local_rank", "nodes", "reason"), [
    (1, 1, "local rank 0 reads for the node"),
    (0, 2, "off with 2 nodes"),
])
def test_one_reader_per_node_and_only_on_one_node(tmp_path: Path, local_rank: int, nodes: int, reason: str) -> None:
    d, _ = _checkpoint(tmp_path)
    reader, why = readahead.start(d, local_rank=local_rank, nodes=nodes)
    assert reader is None and why.startswith(reason)


def test_off_when_asked_when_nothing_is_there_and_when_memory_is_short(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    d, total = _checkpoint(tmp_path)
    assert readahead.start(None, local_rank=0, nodes=1) == (None, "nothing to read (no checkpoint yet)")
    assert readahead.start(tmp_path / "missing", local_rank=0, nodes=1)[0] is None
    monkeypatch.setattr(readahead, "available_memory", lambda: total)  # the checkpoint is all the memory there is
    reader, why = readahead.start(d, local_rank=0, nodes=1)
    assert reader is None and "more than half the available memory" in why
    monkeypatch.setenv(readahead.READAHEAD_ENV, "0")
    assert readahead.start(d, local_rank=0, nodes=1)[1] == f"off ({readahead.READAHEAD_ENV}=0)"


def test_a_file_that_vanishes_is_an_error_in_the_figures_not_an_exception(tmp_path: Path) -> None:
    d, _ = _checkpoint(tmp_path)
    files = [(d / "gone.distcp", 10)]
    reader = readahead.ReadAhead(d, files)
    figures = _wait(reader)
    assert figures["done"] and "FileNotFoundError" in figures["error"]
    assert time.monotonic() - reader.started < 30


def test_only_regular_files_are_read_never_a_link_or_a_fifo(tmp_path: Path) -> None:
    """A FIFO or a link left in an older, group-writable run would hang a reader or read elsewhere."""
    import os

    d, total = _checkpoint(tmp_path)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"\2" * 4096)
    (d / "link.distcp").symlink_to(outside)
    os.mkfifo(d / "fifo.distcp")
    reader, _ = readahead.start(d, local_rank=0, nodes=1)
    assert reader is not None
    figures = _wait(reader)
    assert (figures["bytes"], figures["read_bytes"], figures["done"]) == (total, total, True)
