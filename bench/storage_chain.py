"""Checkpoints on real storage (issue #23), measured as a user would meet them: a chain of short
segments on the local backend, its run root on this machine's disk, sampled every few seconds.

    PYTHONPATH=src python bench/storage_chain.py --out DIR [--recipe train/llama3-1b] [--segment 00:02:00]
        [--train-iters 100] [--trigger-save-at 40] [--dd-gib 8] [--set KEY=VALUE ...]
    PYTHONPATH=src python bench/storage_chain.py --smoke --out DIR     # the tiny recipe on the CPU

Prints and writes OUT/storage_chain.json:
- each segment's outcome, the peak number of checkpoint directories on disk (complete + being written)
  against keep_last + 1, the chain's wall time and the blocking save time as a share of it;
- one checkpoint's bytes (predicted and on disk), save and load bandwidth (bytes / blocking save time,
  bytes / load time from the timelines) beside the disk's own write and read bandwidth (dd, fsync'd
  write, read after dropping the page cache where allowed);
- whether consumed samples are exact (the last checkpoint's iteration x global batch).
No assertion: the figures are the result (docs/results.md quotes them)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if p not in ("", str(Path(__file__).resolve().parent))]
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

GPU_SETS = ["cluster.backend=local", "cluster.gpus_per_node=1", "cluster.tasks_per_node=1",
            "model.seq_length=2048", "model.max_position_embeddings=8192", "training.global_batch_size=32",
            "training.micro_batch_size=8", "training.lr_warmup_iters=5", "training.eval_iters=0",
            "training.log_interval=5", "checkpoint.save_interval=25", "chain.hang_timeout_s=900"]
SMOKE_SETS = ["cluster.backend=local", "checkpoint.save_interval=20", "training.log_interval=5"]


def dd_bandwidth(directory: Path, gib: float) -> dict[str, float | None]:
    """The filesystem's own sequential write (fsync'd) and read bandwidth, in GB/s, on `directory`."""
    path = directory / "dd.bin"
    count = max(1, int(gib * 1024 / 16))
    out: dict[str, float | None] = {"write_gbps": None, "read_gbps": None}
    try:
        t0 = time.monotonic()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fsync"],
                       check=True, capture_output=True)
        out["write_gbps"] = count * 16 * 2**20 / (time.monotonic() - t0) / 1e9
        try:  # a cold read: drop the page cache (root only)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            out["read_cold"] = 1.0
        except OSError:
            out["read_cold"] = 0.0
        t0 = time.monotonic()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
        out["read_gbps"] = count * 16 * 2**20 / (time.monotonic() - t0) / 1e9
    finally:
        path.unlink(missing_ok=True)
    return out


class Sampler(threading.Thread):
    """Counts checkpoint directories (complete and being written) every `every_s` seconds."""

    def __init__(self, checkpoints: Path, every_s: float) -> None:
        super().__init__(daemon=True)
        self.checkpoints, self.every_s = checkpoints, every_s
        self.samples: list[tuple[float, list[str]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            try:
                names = sorted(p.name for p in self.checkpoints.iterdir() if re.fullmatch(r"iter_\d{7}", p.name))
            except OSError:
                continue
            if not self.samples or self.samples[-1][1] != names:
                print(f"on disk ({len(names)}): {' '.join(names)}", flush=True)
            self.samples.append((time.time(), names))

    @property
    def peak(self) -> int:
        return max((len(n) for _, n in self.samples), default=0)


def trigger_when(paths: Any, iteration: int, stop: threading.Event) -> None:
    from megalaunch.rundir.state import read_progress
    from megalaunch.rundir.triggers import TriggerBox

    while not stop.wait(1.0):
        if ((read_progress(paths) or {}).get("iteration") or 0) >= iteration:
            TriggerBox(paths).write("save", "bench: a trigger save")
            return


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


SAVED_LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] successfully saved checkpoint from iteration\s+(\d+)")
SAVE_LINE = re.compile(r"\[megalaunch\] (save at iteration \d+: .*|writer: .*|rank \d+: pinned staging .*)")


def segment_table(paths: Any, nbytes: int | None) -> list[dict[str, Any]]:
    """Each segment as `megalaunch report` / goodput cut it (launcher/accounting/goodput.py), and from its
    timeline: start-up (job begin to the end of the first iteration) and its parts, the load's bandwidth,
    every save's blocking interval; the last save of a segment that ended `saved` is its stop save."""
    import time as _time

    from megalaunch.launcher.accounting.goodput import chain_goodput
    from megalaunch.rundir.files import read_json

    rows = []
    for seg in chain_goodput(paths, _time.time())["segments"]:
        tl = read_json(paths.timeline(seg["job_id"])) or {}
        ph, start = tl.get("phases") or {}, seg["start"]

        def at(phase: str, ph: dict[str, Any] = ph, start: float = start) -> float | None:
            return round(ph[phase] - start, 2) if phase in ph else None

        def span(a: str, b: str, ph: dict[str, Any] = ph) -> float | None:
            return round(ph[b] - ph[a], 2) if a in ph and b in ph else None

        saves = [[it, round(end - begin, 2)] for it, begin, end in tl.get("saves", [])]
        stop = saves[-1] if saves and seg["outcome"] in ("saved", "finished") else None
        load = span("load_start", "load_end") if tl.get("start_iteration") else None
        text = "".join(log.read_text(errors="replace") for log in sorted(paths.logs.glob(f"*-{seg['job_id']}.out")))
        lines = SAVE_LINE.findall(text)
        saved = {int(it): datetime.strptime(when, "%Y-%m-%d %H:%M:%S.%f").timestamp()  # Megatron's local time
                 for when, it in SAVED_LINE.findall(text)}
        to_saved = round(saved[stop[0]] - tl["saves"][-1][1], 2) if stop and stop[0] in saved else None
        rows.append({
            "job_id": seg["job_id"], "outcome": seg["outcome"], "wall_s": round(seg["wall"], 1),
            "parts_s": {k: round(v, 2) for k, v in seg["parts"].items() if v}, "goodput_startup_s": round(seg["startup"], 2),
            "startup_to_first_iteration_s": at("first_iteration_end"),
            "phases_s": {k: at(k) for k in ("process_start", "torch_imported", "megatron_imported", "setup_done",
                                            "distributed_ready", "health_check_start", "health_check_end",
                                            "first_collective", "model_build_start", "model_build_end", "load_start",
                                            "load_end", "data_end", "first_iteration_end") if k in ph},
            "load_s": load, "load_gbps": round(nbytes / load / 1e9, 2) if nbytes and load else None,
            "first_step_s": span("data_end", "first_iteration_end"), "saves_s": saves,
            "stop_save_s": stop[1] if stop else None,
            "stop_save_gbps": round(nbytes / stop[1] / 1e9, 2) if stop and nbytes else None,
            # from the decision to Megatron's "successfully saved" (the interval above adds retention after it)
            "stop_save_to_saved_s": to_saved,
            "stop_save_to_saved_gbps": round(nbytes / to_saved / 1e9, 2) if to_saved and nbytes else None,
            "save_log": lines,
        })
    return rows


def _safe_table(paths: Any, nbytes: int | None) -> Any:
    try:
        return segment_table(paths, nbytes)
    except Exception as e:  # the figures above still come back
        return f"per-segment table failed: {e!r}"


def summarize(paths: Any, sampler: Sampler, wall: float, keep_last: int, gbs: int) -> dict[str, Any]:
    from megalaunch.rundir.files import read_json
    from megalaunch.rundir.ledger import Ledger

    ledger = Ledger(paths)
    segments = [{"job_id": s.job_id, "outcome": s.outcome} for s in ledger.segments()]
    saves, loads = [], []
    for s in segments:
        tl = read_json(paths.timeline(s["job_id"])) or {}
        saves += [end - begin for _, begin, end in tl.get("saves", [])]
        ph = tl.get("phases") or {}
        if s["outcome"] and ph.get("load_start") and ph.get("load_end") and tl.get("start_iteration"):
            loads.append(ph["load_end"] - ph["load_start"])  # segments that resumed from a checkpoint
    last = paths.read_tracker()
    ckpt = paths.checkpoints / f"iter_{last:07d}" if last else None
    nbytes = dir_bytes(ckpt) if ckpt is not None and ckpt.is_dir() else None
    resumed = [e for e in ledger.events() if e["event"] == "resumed"]
    exact = all(e.get("consumed_samples") in (None, e.get("iteration", 0) * gbs) for e in resumed)
    return {
        "segments": segments, "wall_s": round(wall, 1), "keep_last": keep_last, "peak_on_disk": sampler.peak,
        "peak_ok": sampler.peak <= keep_last + 1, "saves_s": [round(x, 2) for x in saves],
        "blocking_save_share": round(sum(saves) / wall, 4) if wall else None,
        "checkpoint_bytes": nbytes, "loads_s": [round(x, 2) for x in loads],
        # bytes over the median blocking save (an async save blocks for less than it writes) and load
        "save_gbps_blocking": round(nbytes / statistics.median(saves) / 1e9, 3) if nbytes and saves else None,
        "load_gbps": round(nbytes / statistics.median(loads) / 1e9, 3) if nbytes and loads else None,
        "consumed_samples_exact": exact, "last_checkpoint": last, "per_segment": _safe_table(paths, nbytes),
        "samples": [[round(t, 1), n] for t, n in sampler.samples],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--root", type=Path, default=Path("/tmp/megalaunch-storage-bench"))
    ap.add_argument("--recipe", default="train/llama3-1b")
    ap.add_argument("--segment", default="00:02:00", help="each segment's time limit")
    ap.add_argument("--train-iters", type=int, default=100)
    ap.add_argument("--trigger-save-at", type=int, default=40)
    ap.add_argument("--dd-gib", type=float, default=8.0)
    ap.add_argument("--dd-streams", type=int, default=8, help="also dd with this many streams at once (1: not)")
    ap.add_argument("--smoke", action="store_true", help="the tiny recipe on the CPU (checks the script)")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    from megalaunch.config.loader import load_recipe
    from megalaunch.launcher.backends.local import run_local_chain
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    args.out.mkdir(parents=True, exist_ok=True)
    args.root.mkdir(parents=True, exist_ok=True)
    recipe_ref = "tiny" if args.smoke else args.recipe
    sets = [*(SMOKE_SETS if args.smoke else GPU_SETS), f"cluster.time={args.segment}",
            f"training.train_iters={args.train_iters}", f"run.root={args.root}", *args.sets]
    disk = dd_bandwidth(args.root, 0.25 if args.smoke else args.dd_gib)
    print(f"disk: write {disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s (dd on {args.root})", flush=True)
    if args.dd_streams > 1:  # the aggregate: as many fsync'd streams as the checkpoint's writer threads
        sys.path.append(str(Path(__file__).resolve().parent))
        from save_profile import dd_bandwidth as dd_streams

        disk["streams"] = args.dd_streams
        agg = dd_streams(args.root, (0.25 if args.smoke else args.dd_gib) * 2**30, args.dd_streams)
        disk["write_gbps_n"], disk["read_gbps_n"] = agg["write_gbps"], agg["read_gbps"]
        print(f"disk, {args.dd_streams} dd streams: write {agg['write_gbps']:.2f} GB/s, read {agg['read_gbps']:.2f} GB/s",
              flush=True)
    prepared = prepare_run(load_recipe(recipe_ref, sets, cluster="local"))
    paths = write_run(prepared)
    sampler = Sampler(paths.checkpoints, 2.0)
    sampler.start()
    stop = threading.Event()
    threading.Thread(target=trigger_when, args=(paths, args.trigger_save_at, stop), daemon=True).start()
    t0 = time.time()
    keep, gbs = prepared.recipe.checkpoint.keep_last, prepared.recipe.training.global_batch_size

    def echo(message: str) -> None:
        print(message, flush=True)
        if message.startswith("segment ") and " done " in message:  # the figures so far, in case of a cut-off
            so_far = summarize(paths, sampler, time.time() - t0, keep, gbs)
            print("so far: " + json.dumps({k: so_far[k] for k in ("segments", "peak_on_disk", "saves_s", "wall_s",
                                                                   "blocking_save_share", "loads_s")}), flush=True)

    verdict = run_local_chain(paths, prepared.recipe, prepared.chain_name, echo=echo)
    wall = time.time() - t0
    stop.set()
    sampler.done.set()
    sampler.join()
    result = {"recipe": recipe_ref, "sets": sets, "verdict": verdict.reason, "disk": disk,
              **summarize(paths, sampler, wall, prepared.recipe.checkpoint.keep_last,
                          prepared.recipe.training.global_batch_size)}
    (args.out / "storage_chain.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
