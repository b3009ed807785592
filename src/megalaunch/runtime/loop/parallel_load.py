"""A resumed segment's checkpoint load, read by several threads (issue #35, start-up). torch's
FileSystemReader (what megatron-core's torch_dist load uses) reads every item of every file in turn
on one thread: `torch.load` of the item into freshly allocated host memory, then the copy to the GPU.
That runs at the speed of one core faulting in fresh pages (8-9 s for llama3-1b's 17.3 GB from the
page cache, 2.0-2.5 GB/s; docs/results.md), far below the disk's or the page cache's bandwidth.

Here the read plan is cut into THREADS parts of about equal bytes (each file's items in order, a
file split where it is larger than its share) and torch's own `read_data` reads each part on a
thread of its own: the reads, the page faults and the copies overlap (the file reads and the copies
release the interpreter lock). Items that are not tensors (pickled objects) stay on the calling
thread, in order, as before. MEGALAUNCH_PARALLEL_LOAD=0 turns it off (the benchmark's "before");
MEGALAUNCH_LOAD_THREADS sets the number of threads (default 8)."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PARALLEL_ENV = "MEGALAUNCH_PARALLEL_LOAD"
THREADS_ENV = "MEGALAUNCH_LOAD_THREADS"
THREADS = 8


def install() -> str:
    """Trainer, before Megatron loads: torch's FileSystemReader reads with threads."""
    if os.environ.get(PARALLEL_ENV, "1") == "0":
        return f"one thread ({PARALLEL_ENV}=0)"
    from torch.distributed.checkpoint import filesystem

    reader = filesystem.FileSystemReader
    if getattr(reader.read_data, "_megalaunch_parallel", False):
        return "already threaded"
    threads = max(1, int(os.environ.get(THREADS_ENV) or THREADS))
    serial = reader.read_data

    def read_data(self: Any, plan: Any, planner: Any) -> Any:
        parts, objects = split_plan(plan.items, self.storage_data, threads)
        if len(parts) <= 1:
            return serial(self, plan, planner)
        done = serial(self, dataclasses.replace(plan, items=objects), planner)  # objects: here, in order
        device = _current_device()
        with ThreadPoolExecutor(len(parts), thread_name_prefix="megalaunch-load") as pool:
            futures = [pool.submit(_read_part, serial, self, dataclasses.replace(plan, items=part), planner, device)
                       for part in parts]
            for f in futures:
                f.result().wait()
        return done

    read_data._megalaunch_parallel = True  # type: ignore[attr-defined]
    reader.read_data = read_data  # type: ignore[method-assign]
    return f"{threads} threads"


def _current_device() -> int | None:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _read_part(serial: Any, reader: Any, plan: Any, planner: Any, device: int | None) -> Any:
    if device is not None:  # a new thread's CUDA device is 0: the trainer's, for anything device-bound
        import torch

        torch.cuda.set_device(device)
    return serial(reader, plan, planner)


def split_plan(items: list[Any], storage: dict[Any, Any], parts: int) -> tuple[list[list[Any]], list[Any]]:
    """The tensor items in up to `parts` lists of about equal bytes (by file, then offset, so each
    thread reads forward through its files) and the other items (objects), in their order."""
    from torch.distributed.checkpoint.planner import LoadItemType

    objects = [i for i in items if i.type == LoadItemType.BYTE_IO]
    tensors = [i for i in items if i.type != LoadItemType.BYTE_IO]
    if parts <= 1 or len(tensors) <= 1:
        return ([tensors] if tensors else []), objects

    def where(item: Any) -> tuple[str, int]:
        info = storage[item.storage_index]
        return str(info.relative_path), int(info.offset)

    tensors.sort(key=where)
    total = sum(int(storage[i.storage_index].length) for i in tensors)
    share = total / parts
    out: list[list[Any]] = [[]]
    filled = 0
    for item in tensors:
        size = int(storage[item.storage_index].length)
        if out[-1] and filled + size / 2 > share * len(out) and len(out) < parts:
            out.append([])
        out[-1].append(item)
        filled += size
    return out, objects
