"""Bounded-memory concurrency for the conversions: a byte budget for the data in flight, not a
thread count.

`run_in_order` hands jobs (one Megatron tensor each) to a small pool of worker threads. A job starts
only when its turn comes (jobs are admitted strictly in order, so a large tensor is never starved by
smaller ones behind it) and its bytes fit in what is left of the budget; a job larger than the whole
budget runs alone. Each job gets a buffer of its size from `BufferPool`, which keeps returned buffers
for reuse (the layers of a model repeat the same sizes, so pages are faulted in once) but never holds
more than the budget in leased plus cached buffers: peak memory is about the budget, whatever the
number of threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

# A cached buffer is reused for a request of at least 1/REUSE_SLACK of its size (else it would hold
# budget that the request does not need).
REUSE_SLACK = 1.25


def _torch_bytes(nbytes: int) -> Any:
    import torch

    # torch.empty does not touch the pages (a bytearray would zero all of them): they are faulted in
    # by the first read into them.
    return torch.empty(nbytes, dtype=torch.uint8)


class Cancelled(Exception):
    """Raised in waiting workers when another worker failed."""


class BufferPool:
    """Leases byte buffers in ticket order while leased + cached bytes stay within `limit`.

    lease(ticket, n) blocks until every lower ticket has been admitted and n more bytes fit (or
    nothing is leased: a request larger than the limit runs alone); give_back(buffer) returns it.
    `allocate(n)` makes a buffer of n bytes (anything with a length, default a torch uint8 tensor).
    The counters (peak_leased, peak_held, max_leases) are for tests and the benchmark."""

    def __init__(self, limit: int, allocate: Callable[[int], Any] | None = None) -> None:
        self.limit = max(1, int(limit))
        self._allocate: Callable[[int], Any] = allocate or _torch_bytes
        self._cond = threading.Condition()
        self._next = 0
        self._leased = 0
        self._leases = 0
        self._cached: list[Any] = []
        self._cached_bytes = 0
        self._cancelled = False
        self.peak_leased = 0
        """Most bytes leased at once (the bytes in flight)."""
        self.peak_held = 0
        """Most bytes leased or cached at once (what the buffers can occupy in memory)."""
        self.max_leases = 0
        """Most buffers leased at once."""
        self.oversized = 0
        """Requests larger than the limit (each ran alone)."""

    # -------------------------------------------------------------------------------- public

    def lease(self, ticket: int, nbytes: int) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: self._cancelled or (ticket == self._next and self._admissible(nbytes)))
            if self._cancelled:
                raise Cancelled
            buffer = self._take_cached(nbytes)
            if buffer is None:
                self._evict(self.limit - self._leased - nbytes)
                buffer = self._allocate(nbytes)
            if nbytes > self.limit:
                self.oversized += 1
            self._leased += len(buffer)
            self._leases += 1
            self._next += 1
            self.peak_leased = max(self.peak_leased, self._leased)
            self.peak_held = max(self.peak_held, self._leased + self._cached_bytes)
            self.max_leases = max(self.max_leases, self._leases)
            self._cond.notify_all()
            return buffer

    def give_back(self, buffer: Any) -> None:
        with self._cond:
            size = len(buffer)
            self._leased -= size
            self._leases -= 1
            if size <= self.limit:
                self._cached.append(buffer)
                self._cached_bytes += size
            self._evict(self.limit - self._leased)
            self._cond.notify_all()

    def skip(self, ticket: int) -> None:
        """Admit `ticket` without a buffer (a job that holds no data)."""
        with self._cond:
            self._cond.wait_for(lambda: self._cancelled or ticket == self._next)
            if self._cancelled:
                raise Cancelled
            self._next += 1
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop the cached buffers (their memory is released)."""
        with self._cond:
            self._evict(0)

    # ------------------------------------------------------------------------------ internal

    def _fit(self, nbytes: int) -> int | None:
        """Index of the smallest cached buffer that serves nbytes without wasting much budget."""
        best = None
        for i, b in enumerate(self._cached):
            size = len(b)
            if nbytes <= size <= nbytes * REUSE_SLACK and (best is None or size < len(self._cached[best])):
                best = i
        return best

    def _admissible(self, nbytes: int) -> bool:
        if self._leased == 0:
            return True
        fit = self._fit(nbytes)
        need = len(self._cached[fit]) if fit is not None else nbytes
        return self._leased + need <= self.limit

    def _take_cached(self, nbytes: int) -> Any:
        fit = self._fit(nbytes)
        if fit is None or (self._leased and self._leased + len(self._cached[fit]) > self.limit):
            return None
        buffer = self._cached.pop(fit)
        self._cached_bytes -= len(buffer)
        return buffer

    def _evict(self, room: int) -> None:
        """Drop cached buffers, largest first, until they take at most `room` bytes."""
        if self._cached_bytes <= max(room, 0):
            return
        self._cached.sort(key=len)
        while self._cached and self._cached_bytes > max(room, 0):
            self._cached_bytes -= len(self._cached.pop())


def run_in_order[J, R](jobs: Sequence[J], nbytes: Callable[[J], int], work: Callable[[J, Any], R], *,
                       threads: int, pool: BufferPool) -> list[R]:
    """work(job, buffer) for every job on `threads` workers, admitted in order under the pool's byte
    budget; the buffer (nbytes(job) bytes, or None for a job of 0 bytes) goes back to the pool as
    soon as work returns. Results in job order; the first error is raised after all workers stop."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []
    lock = threading.Lock()
    counter = iter(range(len(jobs)))

    def worker() -> None:
        while True:
            with lock:
                ticket = next(counter, None)
            if ticket is None or errors:
                return
            job = jobs[ticket]
            size = nbytes(job)
            try:
                if size == 0:
                    pool.skip(ticket)
                    results[ticket] = work(job, None)
                    continue
                buffer = pool.lease(ticket, size)
                try:
                    results[ticket] = work(job, buffer)
                finally:
                    pool.give_back(buffer)
            except Cancelled:
                return
            except BaseException as e:  # re-raised in the caller's thread
                with lock:
                    errors.append(e)
                pool.cancel()
                return

    count = max(1, min(threads, len(jobs)))
    workers = [threading.Thread(target=worker, name=f"megalaunch-convert-{n}", daemon=True) for n in range(count - 1)]
    for t in workers:
        t.start()
    worker()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    return results
