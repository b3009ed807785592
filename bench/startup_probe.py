"""Where a trainer's first seconds go on this machine, one process per GPU at once (as a segment starts):
`import torch`, CUDA initialisation on the process's GPU, and the Megatron imports megalaunch's seams
need, each timed on its own; then the same with CUDA initialised in a thread while the main thread
imports Megatron (does the overlap pay?). Prints seconds per process.

    python bench/startup_probe.py --procs 2          # on a 2-GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, threading, time
t0 = time.time()
import torch
t1 = time.time()
overlap = os.environ["PROBE_OVERLAP"] == "1"
dev = int(os.environ.get("PROBE_DEV", "0"))
def cuda():
    if not torch.cuda.is_available():
        return
    torch.cuda.set_device(dev)
    torch.empty(1, device="cuda")
if overlap:
    th = threading.Thread(target=cuda); th.start()
else:
    cuda()
t2 = time.time()
import megatron.training.training, megatron.core.models.gpt  # what the seams and the model provider import
t3 = time.time()
if overlap:
    th.join()
t4 = time.time()
print(json.dumps({"torch": t1 - t0, "cuda": t2 - t1, "megatron": t3 - t2, "join": t4 - t3, "total": t4 - t0}))
"""


def run(procs: int, overlap: bool) -> list[dict[str, float]]:
    ps = [subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env={**os.environ, "PROBE_OVERLAP": "1" if overlap else "0", "PROBE_DEV": str(i)})
          for i in range(procs)]
    return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in ps]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    opts = ap.parse_args()
    for i in range(opts.repeat):
        for overlap in (False, True):
            start = time.time()
            rows = run(opts.procs, overlap)
            wall = time.time() - start
            cells = ", ".join(f"{k} {v:.2f}" for k, v in rows[0].items())
            print(f"run {i + 1} {'overlap' if overlap else 'serial '}: wall {wall:.2f} s; rank 0: {cells}; "
                  f"totals {[round(r['total'], 2) for r in rows]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
