"""Streaming safetensors I/O and Megatron checkpoint-directory rules (no Megatron needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalaunch.conversion.checkpoint_io import mcore_layout
from megalaunch.conversion.errors import ConversionError, IncompleteCheckpointError, MissingFileError

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from megalaunch.conversion.checkpoint_io.safetensors_io import (  # noqa: E402
    INDEX_NAME,
    SafetensorsReader,
    SafetensorsWriter,
    dtype_code,
)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "b.weight": torch.randn(100, generator=g),
            "c.bias": torch.randn(3, 5, generator=g).half(),
            "d.scalar": torch.tensor(3.5)}


def test_writer_output_is_read_by_safetensors_and_back_bit_exactly(tmp_path: Path) -> None:
    ts = tensors()
    w = SafetensorsWriter(tmp_path, [(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in ts.items()])
    for name in reversed(list(ts)):  # any order
        w.write(name, ts[name])
    w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    loaded = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == ts.keys()
    with SafetensorsReader(tmp_path) as r:
        for name, t in ts.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)
            assert torch.equal(r.read(name), t)


def test_sharded_output_has_an_index_and_reads_back(tmp_path: Path) -> None:
    ts = tensors()
    w = SafetensorsWriter(tmp_path, [(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in ts.items()],
                          max_shard_bytes=4096)
    for name, t in ts.items():
        w.write(name, t)
    w.close()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and files[0] == "model-00001-of-00002.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    with SafetensorsReader(tmp_path) as r:
        assert all(torch.equal(r.read(n), t) for n, t in ts.items())


def test_reader_reads_files_written_by_safetensors(tmp_path: Path) -> None:
    ts = tensors()
    safetensors_torch.save_file(ts, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with SafetensorsReader(tmp_path) as r:
        assert r.tensors["a.weight"].dtype == "BF16" and r.tensors["a.weight"].shape == (64, 32)
        assert all(torch.equal(r.read(n), t) for n, t in ts.items())


def test_unfinished_writer_leaves_nothing_behind(tmp_path: Path) -> None:
    ts = tensors()
    w = SafetensorsWriter(tmp_path, [(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in ts.items()])
    w.write("a.weight", ts["a.weight"])
    with pytest.raises(ConversionError, match="never written"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_wrong_shape_or_dtype(tmp_path: Path) -> None:
    w = SafetensorsWriter(tmp_path, [("x", "F32", (2, 2))])
    with pytest.raises(ConversionError, match=r"declared F32\[2, 2\]"):
        w.write("x", torch.zeros(2, 3))
    with pytest.raises(ConversionError, match="declared"):
        w.write("x", torch.zeros(2, 2, dtype=torch.bfloat16))
    w.abort()


def test_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match=r"no model\.safetensors"):
        SafetensorsReader(tmp_path)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(MissingFileError, match="model-00001-of-00002"):
        SafetensorsReader(tmp_path)
    (tmp_path / INDEX_NAME).unlink()
    safetensors_torch.save_file({"x": torch.zeros(1000)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with SafetensorsReader(tmp_path) as r, pytest.raises(ConversionError, match="truncated"):
        r.read("x")


# --- checkpoint directories --------------------------------------------------------------------------


def fake_iteration(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return d


def test_tracker_rules(tmp_path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError, match=r"latest_checkpointed_iteration\.txt"):
        mcore_layout.resolve(tmp_path)
    (tmp_path / mcore_layout.TRACKER).write_text("garbage")
    with pytest.raises(IncompleteCheckpointError, match="'garbage'"):
        mcore_layout.resolve(tmp_path)
    (tmp_path / mcore_layout.TRACKER).write_text("20\n")
    with pytest.raises(IncompleteCheckpointError, match="iter_0000020, which does not exist"):
        mcore_layout.resolve(tmp_path)
    fake_iteration(tmp_path, "iter_0000030")
    with pytest.raises(IncompleteCheckpointError, match="newer than the tracker's 20"):
        mcore_layout.resolve(tmp_path, 30)
    with pytest.raises(IncompleteCheckpointError, match="newer than the tracker's 20"):
        mcore_layout.resolve(tmp_path / "iter_0000030")
    with pytest.raises(MissingFileError, match="iter_0000030"):
        mcore_layout.resolve(tmp_path, 10)


def test_iteration_without_metadata_is_incomplete(tmp_path: Path) -> None:
    (tmp_path / "iter_0000010").mkdir()
    (tmp_path / mcore_layout.TRACKER).write_text("10")
    with pytest.raises(IncompleteCheckpointError, match=r"no metadata\.json"):
        mcore_layout.resolve(tmp_path)
    (tmp_path / "iter_0000010" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(IncompleteCheckpointError, match=r"no \.metadata"):
        mcore_layout.resolve(tmp_path)
    (tmp_path / "iter_0000010" / ".metadata").write_bytes(b"\x80\x04truncated")
    with pytest.raises(IncompleteCheckpointError, match="unreadable"):
        mcore_layout.resolve(tmp_path)


def test_run_directory_means_its_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / mcore_layout.TRACKER).write_text("release")
    fake_iteration(tmp_path / "checkpoints", "release").joinpath("metadata.json").write_text(
        json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(ConversionError, match="'zarr' checkpoint"):
        mcore_layout.resolve(tmp_path)
    with pytest.raises(MissingFileError, match="does not exist"):
        mcore_layout.resolve(tmp_path / "nope")
