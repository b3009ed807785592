"""What a fork server for the tests' trainer ranks would save (issue 36: CI within 15 minutes).

    python bench/fork_trainer.py [--repeat 3]

A trainer rank is the Megatron tests' unit of cost: tests/megatron/harness.py starts each rank as a fresh
`python -m megalaunch.runtime.task -- python -m megalaunch.runtime.train RUN`, which imports torch and
Megatron every time. This runs the same 3-iteration tiny run (1 rank, CPU) both ways, side by side:

- `fresh`: the harness's way (tests/megatron/harness.Trainer: the task supervisor, then the trainer);
- `forked`: one parent imports what the trainer imports (runtime/model/megatron_import.import_megatron and
  the trainer's modules) once, then forks a child per run that calls `megalaunch.runtime.train.main` with
  the rank's environment, the stop signal blocked as the supervisor blocks it, and its output to a file.

It prints each run's wall and CPU seconds (user + system of the child and what it started) and the
parent's one-time import cost. Both must end `finished` at iteration 3."""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO), str(REPO / "tests" / "megatron")]
SETS = ("training.train_iters=3", "training.lr_warmup_iters=1")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def fresh(root: Path) -> tuple[float, float, str]:
    from harness import Trainer, make_run

    paths = make_run(root, *SETS)
    cpu, t0 = _children_cpu(), time.perf_counter()
    trainer = Trainer(paths, world=1, fresh=True)
    codes = trainer.wait()
    outcome = trainer.outcome()
    assert codes == [0], trainer.log()[-2000:]
    return time.perf_counter() - t0, _children_cpu() - cpu, f"{outcome['status']} at {outcome.get('iteration')}"


def forked(root: Path) -> tuple[float, float, str]:
    from harness import make_run

    from megalaunch.rundir.files import read_json
    from megalaunch.runtime import train
    from megalaunch.runtime.rank.dist_env import free_port

    paths = make_run(root, *SETS)
    env = {"MEGALAUNCH_RUN_DIR": str(paths.root), "MEGALAUNCH_JOB_ID": "1", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    cpu, t0 = _children_cpu(), time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the rank: what the supervisor would give it, then the trainer's own entry
        code = 1
        try:
            os.setsid()
            os.environ.update(env)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
            fd = os.open(root / "rank0.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = train.main([str(paths.root)]) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    wall, used = time.perf_counter() - t0, _children_cpu() - cpu
    assert os.waitstatus_to_exitcode(status) == 0, (root / "rank0.log").read_text()[-2000:]
    outcome = read_json(paths.outcome) or {}
    return wall, used, f"{outcome.get('status')} at {outcome.get('iteration')}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # as scripts/test runs the suite
    tmp = Path(tempfile.mkdtemp(prefix="ml-fork-trainer-"))
    try:
        t0 = time.process_time()
        from megalaunch.runtime.model.megatron_import import import_megatron

        import_megatron()
        import megalaunch.runtime.loop.megatron_seams
        import megalaunch.runtime.train  # noqa: F401
        parent = time.process_time() - t0
        rows: dict[str, list[tuple[float, float, str]]] = {"fresh": [], "forked": []}
        for i in range(args.repeat):  # interleaved: the machine's speed drifts
            for kind, run in (("fresh", fresh), ("forked", forked)):
                rows[kind].append(run(tmp / f"{kind}{i}"))
        print(f"parent's imports (once per server): {parent:.2f} CPU-s")
        print(f"{'start':<8} {'wall s (median)':>16} {'CPU s (median)':>15}  runs")
        for kind, got in rows.items():
            print(f"{kind:<8} {statistics.median(w for w, _, _ in got):16.2f} {statistics.median(c for _, c, _ in got):15.2f}"
                  f"  {'; '.join(f'{w:.2f} s / {c:.2f} CPU-s, {o}' for w, c, o in got)}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
