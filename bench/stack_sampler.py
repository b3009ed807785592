"""A poor man's sampling profiler for one thread (no py-spy on the device): every `every_s` the thread's
Python stack is taken from sys._current_frames(); time inside C calls (CUDA IPC, page faults, locks)
lands on the Python line that made the call. `summary()` prints the lines seen most, innermost
frame with its two callers. Used by bench/staging_check.py for the trainer's hand-off and, through
`profiled_writer_main`, inside Megatron's checkpoint writer process."""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any

IDLE = ("wait", "recv_bytes", "_recv_bytes", "_recv", "poll", "select", "acquire", "sleep", "_wait_for_tstate_lock",
        "accept", "serve_forever", "handle_request", "readinto", "_worker", "recv")


class Sampler(threading.Thread):
    """Samples every thread of the process but the samplers; a sample whose innermost frame waits is idle."""

    def __init__(self, every_s: float = 0.02, name: str = "main") -> None:
        super().__init__(daemon=True, name="stack-sampler")
        self.every_s, self.label = every_s, name
        self.counts: collections.Counter[str] = collections.Counter()
        self.busy = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.every_s):
            threads = {t.ident: t.name for t in threading.enumerate()}
            busy = False
            for ident, frame in sys._current_frames().items():
                tname = threads.get(ident, "?")
                if tname.startswith("stack-"):
                    continue
                names = []
                while frame is not None and len(names) < 3:
                    code = frame.f_code
                    names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                if not names or names[0].split(":")[1] in IDLE:
                    continue
                busy = True
                self.counts[f"[{tname}] " + " <- ".join(names)] += 1
            self.busy += busy

    def summary(self, top: int = 12, reset: bool = True) -> str:
        lines = [f"[sampler {self.label}] {self.busy * self.every_s:.2f} s busy"]
        lines += [f"  {n * self.every_s:6.2f} s  {stack}" for stack, n in self.counts.most_common(top)]
        if reset:
            self.counts.clear()
            self.busy = 0
        return "\n".join(lines)

    def stop(self) -> None:
        self.stop_event.set()


def profiled_writer_main(*args: Any) -> None:
    """save_staging.writer_main with the writer's main thread sampled; a summary after every request
    (printed when the thread has been idle for a second after being busy)."""
    from megalaunch.runtime.loop import save_staging

    sampler = Sampler(name="writer")
    sampler.start()
    threading.current_thread().name = "writer-main"

    def report() -> None:
        seen = 0
        while True:
            time.sleep(1.0)
            if sampler.busy and sampler.busy == seen:
                print(sampler.summary(), flush=True)
                seen = 0
            else:
                seen = sampler.busy

    threading.Thread(target=report, daemon=True, name="stack-report").start()
    save_staging.writer_main(*args)
