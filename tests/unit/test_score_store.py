"""The score store (runtime/scoring/store.py): rows aligned with the chat dataset's token stream, a writer
that continues from documents_done after a stop, a reader per document, a store of another model or of
changed data started afresh, the model fingerprint, and the bytes it holds."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from megalaunch.runtime.scoring.store import (
    ScoreReader,
    ScoreWriter,
    document_layout,
    fingerprint,
    mismatch,
    read_meta,
    store_bytes,
)


def write_dataset(prefix: Path, lengths: list[int]) -> None:
    """A Megatron MMIDIDX dataset (int32 tokens) with documents of these lengths, and its mask."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    total = sum(lengths)
    np.arange(total, dtype=np.int32).tofile(str(prefix) + ".bin")
    np.ones(total, dtype=np.uint8).tofile(str(prefix) + ".mask")
    sizes = np.array(lengths, dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]).astype(np.int64) * 4
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, len(lengths), len(lengths) + 1))
        f.write(sizes.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())


MODEL = {"fingerprint": "f" * 64, "source": "RUN/pretrained"}


def test_writer_continues_from_documents_done_and_reader_aligns(tmp_path: Path) -> None:
    lengths = [5, 3, 7, 4]
    write_dataset(tmp_path / "d" / "train", lengths)
    prefixes = [str(tmp_path / "d" / "train")]
    offsets, got_lengths = document_layout(prefixes[0])
    assert list(offsets) == [0, 5, 8, 15] and list(got_lengths) == lengths
    scores = [np.linspace(-1, -2, n).astype(np.float32) for n in lengths]
    scores[2] = scores[2][:4]  # a document longer than the job's sequences: the rest stays zeros

    w = ScoreWriter(tmp_path / "s", kind="logprobs", prefixes=prefixes, model=MODEL)
    w.append("train", scores[:2])
    w.flush(seconds=2.0, tokens=8)
    w.append("train", scores[2:3])  # not flushed: a stop here loses it, documents_done says 2
    w.close()
    assert read_meta(tmp_path / "s")["documents_done"] == {"train": 2}

    w = ScoreWriter(tmp_path / "s", kind="logprobs", prefixes=prefixes, model=MODEL)
    assert w.restarted_because is None and w.done("train") == 2
    w.append("train", scores[2:])
    w.flush(seconds=2.0, tokens=8, complete=True)
    w.close()
    meta = read_meta(tmp_path / "s")
    assert meta["complete"] and meta["documents_done"] == {"train": 4}
    assert meta["seconds"] == 4.0 and meta["tokens_per_s"] == 4.0
    assert meta["data"]["train"]["documents"] == 4 and meta["data"]["train"]["tokens"] == 19

    r = ScoreReader(tmp_path / "s", prefixes)
    assert r.complete
    for d, n in enumerate(lengths):
        row = r.get("train", d)
        assert row.shape == (n,) and row.dtype == np.float32
        np.testing.assert_array_equal(row[: len(scores[d])], scores[d])
        assert not row[len(scores[d]):].any()
    assert (tmp_path / "s" / "train.logp").stat().st_size == 19 * 4
    assert store_bytes(tmp_path / "s") >= 19 * 4


def test_topk_rows_and_a_store_of_another_model_or_data_starts_afresh(tmp_path: Path) -> None:
    write_dataset(tmp_path / "d" / "a", [3, 2])
    prefixes = [str(tmp_path / "d" / "a")]
    ids = [np.arange(6, dtype=np.int32).reshape(3, 2), np.array([[7, 8], [9, 1]], dtype=np.int32)]
    logp = [np.full((3, 2), -0.5, np.float32), np.full((2, 2), -1.5, np.float32)]
    w = ScoreWriter(tmp_path / "s", kind="topk", top_k=2, prefixes=prefixes, model=MODEL)
    w.append("a", list(zip(ids, logp, strict=True)))
    w.flush(complete=True)
    w.close()
    r = ScoreReader(tmp_path / "s", prefixes)
    got_ids, got_logp = r.get("a", 1)
    np.testing.assert_array_equal(got_ids, ids[1])
    np.testing.assert_array_equal(got_logp, logp[1])

    other = {"fingerprint": "0" * 64, "source": "elsewhere"}
    assert "computed by model 'RUN/pretrained'" in mismatch(r.meta, kind="topk", top_k=2, model=other,
                                                            data=r.meta["data"]).reason
    w = ScoreWriter(tmp_path / "s", kind="topk", top_k=2, prefixes=prefixes, model=other)
    assert w.restarted_because is not None and w.done("a") == 0
    assert not (tmp_path / "s" / "a.topk_ids").exists()
    w.close()

    write_dataset(tmp_path / "d" / "a", [3, 3])  # the data changed under the store
    w = ScoreWriter(tmp_path / "s", kind="topk", top_k=2, prefixes=prefixes, model=other)
    assert "dataset a changed" in w.restarted_because.reason
    with pytest.raises(IndexError, match="not scored yet"):
        ScoreReader(tmp_path / "s", prefixes).get("a", 0)


def test_fingerprint_follows_the_weights_not_the_tracker(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000001").mkdir(parents=True)
    (ckpt / "iter_0000001" / "weights.distcp").write_bytes(b"\x01" * 5000)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    first = fingerprint(ckpt)
    (ckpt / "iter_0000002").mkdir()
    (ckpt / "iter_0000002" / "weights.distcp").write_bytes(b"\x03" * 5000)
    assert fingerprint(ckpt) == first == fingerprint(ckpt / "iter_0000001")  # the iteration the tracker names
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    assert fingerprint(ckpt) != first
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    (ckpt / "iter_0000001" / "weights.distcp").write_bytes(b"\x01" * 4999 + b"\x02")
    assert fingerprint(ckpt) != first
    assert json.dumps(first) and len(first) == 64
