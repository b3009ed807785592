"""The checkpoint writer's pinned staging (runtime/loop/save_staging.py): its size and the memory check
before it is used; the threaded checkpoint read (runtime/loop/parallel_load.py): how the read plan is cut
and that a load through it reads every item right. On the GPU: bench/staging_check.py, docs/results.md."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from megalaunch.runtime.loop import save_staging

GB = 10**9


def test_the_arena_is_one_ranks_share_of_a_checkpoint_with_room_for_imbalance() -> None:
    assert save_staging.arena_bytes(None, 1) is None
    one = save_staging.arena_bytes(17_302_248_283, 1)
    assert one is not None and 17.3 * GB < one < 17.8 * GB  # +2 % and 64 MB
    eight = save_staging.arena_bytes(112 * GB, 8)
    assert eight is not None and 14 * GB < eight < 15.5 * GB  # 1/8 + 10 %


def test_the_arena_is_used_only_when_the_nodes_ranks_fit_in_half_the_available_memory() -> None:
    fits, figures = save_staging.memory_check(18 * GB, 1, 125 * GB)
    assert fits and figures == "18.0 GB pinned per rank, 18.0 GB for the node's 1 rank(s), 125 GB available"
    fits, figures = save_staging.memory_check(18 * GB, 4, 125 * GB)  # 72 GB > 62.5 GB
    assert not fits and "72.0 GB for the node's 4 rank(s)" in figures and "Megatron's own staging" in figures
    assert save_staging.memory_check(18 * GB, 1, None)[0] is False  # no /proc/meminfo: not used
    assert save_staging.memory_check(None, 1, 125 * GB) == (False, "the checkpoint's size is not known")


def test_staging_stays_off_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(save_staging.STAGING_ENV, "0")
    assert save_staging.install(17 * GB, 1, 1) == f"off ({save_staging.STAGING_ENV}=0)"
    assert save_staging._ARENA_BYTES is None


def test_a_request_keeps_its_staging_while_the_arena_is_off() -> None:
    import functools

    def preload(buckets: list, non_blocking: bool) -> list:
        return buckets

    request = SimpleNamespace(async_fn=print, preload_fn=functools.partial(preload, ["b"], True),
                              _replace=lambda **kw: SimpleNamespace(**{**request.__dict__, **kw}))
    out = save_staging.staged(request)
    assert out.preload_fn is request.preload_fn  # Megatron's own staging
    assert isinstance(out.async_fn, functools.partial) and out.async_fn.args == (print,)  # the write timed


def _items(sizes: dict[str, list[int]]) -> tuple[list, dict]:
    from torch.distributed.checkpoint.planner import LoadItemType

    items, storage = [], {}
    for path, lengths in sizes.items():
        offset = 0
        for i, length in enumerate(lengths):
            key = (path, i)
            items.append(SimpleNamespace(type=LoadItemType.TENSOR, storage_index=key))
            storage[key] = SimpleNamespace(relative_path=path, offset=offset, length=length)
            offset += length
    items.append(SimpleNamespace(type=LoadItemType.BYTE_IO, storage_index=("common", 0)))
    return items, storage


def test_the_read_plan_is_cut_into_parts_of_about_equal_bytes_each_reading_forward() -> None:
    pytest.importorskip("torch")
    from megalaunch.runtime.loop.parallel_load import split_plan

    items, storage = _items({"__0_1.distcp": [100] * 8, "__0_0.distcp": [100] * 8})
    parts, objects = split_plan(items, storage, 4)
    assert [len(p) for p in parts] == [4, 4, 4, 4] and len(objects) == 1
    order = [(storage[i.storage_index].relative_path, storage[i.storage_index].offset) for p in parts for i in p]
    assert order == sorted(order)  # by file, then offset: every thread reads forward
    one_file, _ = split_plan(*_items({"__0_0.distcp": [50] * 10}), 8)
    assert len(one_file) > 1  # a checkpoint written by one thread is still read by several
    assert len(split_plan(*_items({"a": [10]}), 8)[0]) == 1


def test_a_load_through_the_threaded_read_equals_the_saved_state(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, filesystem

    from megalaunch.runtime.loop import parallel_load

    serial = filesystem.FileSystemReader.read_data
    state = {f"t{i}": torch.randn(500 + 37 * i) for i in range(24)}
    state["common"] = io.BytesIO(b"common state")
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path), thread_count=3), no_dist=True)
    try:
        assert parallel_load.install() == f"{parallel_load.THREADS} threads"
        target = {k: torch.zeros_like(v) for k, v in state.items() if k != "common"}
        target["common"] = io.BytesIO()
        dcp.load(target, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    finally:
        filesystem.FileSystemReader.read_data = serial  # type: ignore[method-assign]
    assert all(torch.equal(target[k], state[k]) for k in state if k != "common")
    assert target["common"].getvalue() == b"common state"
