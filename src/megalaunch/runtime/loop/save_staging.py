"""Pinned staging for asynchronous checkpoint saves (issue #35): the part of a save that blocks training
is the copy of the state off the GPU, and Megatron's persistent writer makes that copy with
`tensor.to("cpu", non_blocking=True)`, which takes fresh pinned host memory for every tensor (torch's
caching host allocator, each block rounded up to a power of two) the first time a process saves. For
llama3-1b on one H100 that blocked the first save of every segment 6.6-10.9 s, against 0.4 s for the
saves after it (docs/results.md, issue #35; 0.5 s with the arena, the first save included).

Here the writer process owns one pinned arena of this rank's share of a checkpoint, allocated once, in
the background, once the trainer's first iteration is done (so it competes with neither the load nor
the first step), and reused by every save of the segment: the staging copy is a device-to-pinned copy into
it (~50 GB/s on an H100), the first save of a segment included. A tensor that does not fit (the
share is a prediction) is staged the way Megatron does it. The writer also skips torch.save's CRC32
of every record (torch.load never checks it; `torch.serialization.set_crc32_options`), and imports
its write path beside the arena rather than when the first request arrives.

Host-memory cost, stated and checked before it is used (`install`, in the trainer, before Megatron
starts the writer): the arena is this rank's share of one checkpoint (the predicted checkpoint bytes
/ world size, +2 % on one rank, +10 % on several, and 64 MB), so a node holds one checkpoint's share of its ranks in pinned memory,
no more than Megatron's own staging pins (which rounds every tensor up to a power of two). It is used
only when the node's ranks together need at most MEMORY_SHARE of the memory available at start-up;
otherwise Megatron's staging stays. MEGALAUNCH_PINNED_STAGING=0 turns it off (the benchmark's
"before")."""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

from megalaunch.runtime.rank.dist_env import available_memory

STAGING_ENV = "MEGALAUNCH_PINNED_STAGING"
WRITE_GATE_ENV = "MEGALAUNCH_TEST_WRITE_GATE"
MEMORY_SHARE = 0.5  # of MemAvailable at start-up, for all ranks of the node together
ALIGN = 4096
_ARENA_BYTES: int | None = None  # trainer: the arena each writer allocates (None: off)
_GO: Any = None  # trainer: the event that lets the writer allocate (set after the first iteration)
_RELEASED = False
_SAVE_BEGUN = 0.0


def arena_bytes(checkpoint_bytes: int | None, world_size: int) -> int | None:
    """This rank's share of one checkpoint, with room for imbalance and alignment."""
    if not checkpoint_bytes or world_size < 1:
        return None
    share = checkpoint_bytes / world_size
    return int(share * (1.02 if world_size == 1 else 1.10)) + (64 << 20)


def install(checkpoint_bytes: int | None, world_size: int, local_ranks: int) -> str:
    """Trainer, after Megatron is imported and before it starts its writer: the arena on or off, and why."""
    global _ARENA_BYTES
    if os.environ.get(STAGING_ENV, "1") == "0":
        return f"off ({STAGING_ENV}=0)"
    import torch

    if not torch.cuda.is_available() or os.environ.get("MEGALAUNCH_TEST_CPU_ASYNC_SAVE") == "1":
        return "off (no GPU)"
    need = arena_bytes(checkpoint_bytes, world_size)
    fits, figures = memory_check(need, local_ranks, available_memory())
    if need is None or not fits:
        return f"off ({figures})"
    from megatron.core.dist_checkpointing.strategies import async_utils

    _ARENA_BYTES = need
    async_utils.PersistentAsyncCaller._get_process = classmethod(_get_process)  # type: ignore[method-assign,assignment]
    return f"on ({figures})"


def memory_check(need: int | None, local_ranks: int, available: int | None) -> tuple[bool, str]:
    """Whether the arenas of the node's ranks fit in MEMORY_SHARE of the memory available, and the figures."""
    if need is None:
        return False, "the checkpoint's size is not known"
    node = need * max(1, local_ranks)
    figures = (f"{need / 1e9:.1f} GB pinned per rank, {node / 1e9:.1f} GB for the node's {max(1, local_ranks)} "
               f"rank(s), {(available or 0) / 1e9:.0f} GB available")
    if available is None or node > MEMORY_SHARE * available:
        return False, f"{figures}: more than {MEMORY_SHARE:.0%} of it; Megatron's own staging"
    return True, figures


def _get_process(cls: Any, rank: int, mp_mode: str = "spawn", cpu_priority: int = 10,
                 io_priority: int | None = None) -> Any:
    """megatron-core 0.19.2's PersistentAsyncCaller._get_process, its worker started by `writer_main`."""
    global _GO
    if cls._persistent_process is None:
        import logging

        from torch import multiprocessing as mp

        ctx: Any = mp.get_context(mp_mode)
        cls._persistent_queue = ctx.JoinableQueue()
        cls._persistent_preload_q = ctx.JoinableQueue()
        cls._persistent_comp_q = ctx.Queue()
        _GO = ctx.Event()
        level = logging.getLogger("megatron.core.dist_checkpointing.strategies.async_utils").getEffectiveLevel()
        cls._persistent_process = ctx.Process(target=writer_main, args=(
            rank, cls._persistent_queue, cls._persistent_preload_q, cls._persistent_comp_q, level, cpu_priority,
            io_priority, _ARENA_BYTES, _GO))
        cls._persistent_process.daemon = True
        cls._persistent_process.start()
    return cls._persistent_process


def release() -> None:
    """Trainer, every iteration (cheap): after the first, the writer may take its memory (not during the
    load and the first step, which it would slow down)."""
    global _RELEASED
    if _GO is not None and not _RELEASED:
        _GO.set()
        _RELEASED = True


def save_begun() -> None:
    global _SAVE_BEGUN
    _SAVE_BEGUN = time.monotonic()


def staged(request: Any) -> Any:
    """Trainer: an asynchronous save's request, its write timed (the log's figures) and, with the
    arena on, its staging into the arena; with the test hook MEGALAUNCH_TEST_WRITE_GATE=PATH, its write
    held until PATH exists (a write in flight for as long as a test needs, without guessing durations)."""
    request = _staged(request)
    gate = os.environ.get(WRITE_GATE_ENV)
    if gate and request.async_fn is not None:
        request = request._replace(async_fn=functools.partial(_gated_write, gate, request.async_fn))
    return request


def _gated_write(gate: str, write: Any, *args: Any, **kwargs: Any) -> Any:
    """The writer (its process), test hook: wait until the file `gate` exists, then write."""
    if not os.path.exists(gate):
        print(f"[megalaunch] test hook: the writer waits for {gate}", flush=True)
        while not os.path.exists(gate):
            time.sleep(0.02)
    return write(*args, **kwargs)


def _staged(request: Any) -> Any:
    preload = request.preload_fn
    if request.async_fn is None or not isinstance(preload, functools.partial) or not preload.args:
        return request
    request = request._replace(async_fn=functools.partial(_timed_write, request.async_fn))
    if os.environ.get("MEGALAUNCH_TEST_CPU_ASYNC_SAVE") == "1":  # test hook: a CPU "staging" copies too
        return request._replace(preload_fn=functools.partial(_cpu_snapshot, preload))
    return request if _ARENA_BYTES is None else request._replace(preload_fn=functools.partial(stage, preload.args[0]))


def _cpu_snapshot(preload: Any) -> list[Any]:
    """The writer, with asynchronous saves on a CPU (MEGALAUNCH_TEST_CPU_ASYNC_SAVE): Megatron's staging is
    `tensor.to("cpu")`, which on a CPU tensor (shared with the trainer through the request) is the tensor
    itself, so a write held back would write a later state than the save's. A GPU's staging copies at
    the hand-off; this copies there too, so that a CPU test's checkpoint is its iteration's state."""
    return [(file_name, key, (data, [(item, t.clone()) for item, t in tensors]))
            for file_name, key, (data, tensors) in preload()]


def handed_over(iteration: int, begin: float) -> None:
    """Trainer, rank 0: how the blocking part of an asynchronous save divides (the log's figures)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    now = time.monotonic()
    print(f"[megalaunch] save at iteration {iteration}: state and plan {begin - _SAVE_BEGUN:.2f} s, staging "
          f"{now - begin:.2f} s (handed to the writer)", flush=True)


# --- the writer process ---------------------------------------------------------------------------------

class _Arena:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.ready = threading.Event()
        self.array: Any = None  # numpy view of the pinned buffer (torch.frombuffer carves tensors of their own)
        self.buffer: Any = None
        self.nbytes = 0

    def allocate(self, rank: int, nbytes: int, go: Any) -> None:
        go.wait()
        self.started.set()
        try:
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
            t0 = time.monotonic()
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
            if int(error) != 0:
                print(f"[megalaunch] rank {rank}: pinned staging not registered (CUDA error {int(error)})", flush=True)
                return
            self.buffer, self.array, self.nbytes = buffer, buffer.numpy(), nbytes
            t1 = time.monotonic()
            _import_write_path()
            print(f"[megalaunch] rank {rank}: pinned staging ready, {nbytes / 1e9:.1f} GB in {t1 - t0:.1f} s "
                  f"(the write path imported in {time.monotonic() - t1:.1f} s)", flush=True)
        except Exception as e:  # never a reason to lose a checkpoint: Megatron's staging stays
            print(f"[megalaunch] rank {rank}: pinned staging not allocated: {e}", flush=True)
        finally:
            self.ready.set()

    def take(self) -> Any:
        if self.started.is_set():
            self.ready.wait()
        return self if self.array is not None else None


_ARENA = _Arena()


def _import_write_path() -> None:
    """What the writer would otherwise import when the first request arrives (unpickling it, then
    writing), while the trainer waits for it: most of it is imported with Megatron's own modules at the
    writer's start already (0.0 s measured on the device), the rest is not left to chance."""
    import importlib

    for name in ("megatron.core.dist_checkpointing.strategies.filesystem_async",
                 "megatron.core.dist_checkpointing.strategies.state_dict_saver", "torch.distributed.checkpoint.filesystem",
                 "torch.multiprocessing.reductions", "multiprocessing.managers", "torch.serialization"):
        importlib.import_module(name)


def writer_main(rank: int, queue: Any, preload_q: Any, comp_q: Any, log_level: int, cpu_priority: int,
                io_priority: int | None, nbytes: int, go: Any) -> None:
    """The persistent writer: the arena allocated beside Megatron's own loop."""
    import torch
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    threading.Thread(target=_ARENA.allocate, args=(rank, nbytes, go), daemon=True,
                     name="megalaunch-staging").start()
    if hasattr(torch.serialization, "set_crc32_options"):
        torch.serialization.set_crc32_options(False)
    PersistentAsyncCaller.async_loop(rank, queue, preload_q, comp_q, log_level, cpu_priority, io_priority)


def stage(write_buckets: list[Any]) -> list[Any]:
    """FileSystemWriterAsync.preload_tensors, into the arena; whatever goes wrong, Megatron's own (an
    exception here would end the writer, and the trainer would wait for it forever)."""
    try:
        return _stage(write_buckets)
    except Exception as e:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        print(f"[megalaunch] writer: staging into the arena failed ({e}); Megatron's staging", flush=True)
        return FileSystemWriterAsync.preload_tensors(write_buckets, True)  # type: ignore[no-any-return]


def _stage(write_buckets: list[Any]) -> list[Any]:
    """Every tensor gets its own storage in the arena (a torch.save of a view would write the whole
    arena), at an aligned offset."""
    import torch

    t0, arena = time.monotonic(), _ARENA.take()
    offset = outside = 0
    result = []
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        tensors = []
        for item, tensor in tensor_data:
            size = tensor.numel() * tensor.element_size()
            if arena is not None and tensor.is_cuda and size > 0 and offset + size <= arena.nbytes:
                host = torch.frombuffer(arena.array, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
                host = host.view(tensor.shape)
                host.copy_(tensor, non_blocking=True)
                offset += -(-size // ALIGN) * ALIGN
            else:
                host = tensor.to("cpu", non_blocking=True)
                outside += size
            tensors.append((item, host))
            del tensor
        result.append((file_name, storage_key, (bytes_data, tensors)))
    torch.cuda.synchronize()
    print(f"[megalaunch] writer: staged {(offset + outside) / 1e9:.2f} GB in {time.monotonic() - t0:.2f} s "
          f"({offset / 1e9:.2f} GB into the arena of {(arena.nbytes if arena else 0) / 1e9:.2f} GB, "
          f"{outside / 1e9:.2f} GB outside)", flush=True)
    return result


def _timed_write(write: Any, rank: int, buckets: list[Any], *args: Any, **kwargs: Any) -> Any:
    t0 = time.monotonic()
    result = write(rank, buckets, *args, **kwargs)
    size = sum(t.numel() * t.element_size() for _, _, (_, tensors) in buckets for _, t in tensors)
    seconds = time.monotonic() - t0
    print(f"[megalaunch] writer: wrote {size / 1e9:.2f} GB in {seconds:.2f} s "
          f"({size / 1e9 / max(seconds, 1e-9):.2f} GB/s, {len(buckets)} file(s))", flush=True)
    return result
