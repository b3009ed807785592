"""The real trainer (`python -m megalaunch.runtime.train`, Megatron's loop on the CPU) on the local
Slurm cluster: the `tiny` recipe on 2 ranks as a chain of >= 3 segments that also save periodically
(and once on a `trigger save`), each stopped by Slurm's own time-limit warning (SIGUSR2, which Slurm
sends to every process of the step, checkpoint writers included), resuming exactly; and the
save/exit/abort triggers on 2 processes, acted on by both ranks at the same iteration (asserted from
each rank's lines in the segment log).

Iterations are paced with the trainer's test hook MEGALAUNCH_TEST_STEP_SLEEP_S (every rank sleeps that
long after each iteration), so the number of iterations per segment depends on Slurm's timing, not on
how busy this 2-core machine is."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import TERMINAL_STATES, job_state, queue_ids, wait_for, wait_job_done
from launch import PYTHON, job_cli, ledger, megalaunch, run_dir_of, submitted_ids, trainer_python

from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import TriggerBox
from megalaunch.runtime.checkpoint.resume import checkpoint_iterations, is_complete
from megalaunch.runtime.rank.dist_env import free_port

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron") is None,
                       reason="needs torch + megatron-core (the [train] extra)"),
]

GBS = 4  # 4 sequences per step: divisible by micro-batch 1 x DP 1 and DP 2 (2 micro-batches per rank at DP 2)

# --- the chain's timing arithmetic ---------------------------------------------------------------
# Lead L = save 10 + step 2 + Slurm's check period 30 + margin 18 = 60 s (FACTS: >= 60 s), so in a
# 180 s segment the USR2 warning comes 60..90 s before the limit: 90..120 s after the segment starts.
# Before the first iteration: `job begin` + Python/Megatron start-up (+ a checkpoint load when
# resuming): 5 s measured on an idle machine, up to ~25 s when busy. Training window per segment:
#   W = (90..120) - (5..25) = 65..115 s.
# One iteration = STEP_SLEEP_S (2 s) + the step itself (15..300 ms here): T = 2.015..2.3 s, so a
# segment trains n = W / T = 28..57 iterations (~47 typical: W ~97 s, T ~2.05 s). The pacing is what
# makes the count Slurm's, not the machine's; the slower it is, the less CPU a segment burns waiting
# for its warning (each iteration ~0.1 CPU-s on the two ranks: ~90 -> ~47 iterations a segment, at
# half the batch of before, took ~60 CPU-s off a CI run).
# TRAIN_ITERS = 124 > 2 x 57 (+10 of slack for a warning a little later than asked): two segments
# can never reach it, so >= 3 segments always. Typically 3 (the first three give ~140 > 124); when
# the machine is busy (n ~ 30-35) a 4th, rarely a 5th.
# Wall time: a stopped segment lasts ~95..125 s (warning + one step + a ~2 s save + `job end`), the
# gap to the next one ~1..6 s (singleton dependency, sched_interval 5 s), the last one
# start-up + rest x T: ~5.5 min typical for 3 segments, ~8 min for 4, ~10 min for 5. Bounded below
# by CHAIN_TIMEOUT_S.
STEP_SLEEP_S = 2.0
TRAIN_ITERS = 124
CHAIN_TIMEOUT_S = 960

ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.*?\| lm loss: ([0-9.eE+-]+) \|")
DECISION_LINE = re.compile(r"\[megalaunch rank (\d+)\] decision (\w+) at iteration (\d+)")
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
SAVED_LINE = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) ")




def train_recipe(tmp: Path, name: str, *, tasks_per_node: int = 1, step_sleep_s: float = STEP_SLEEP_S,
                 python: str = PYTHON, **sections: dict[str, Any]) -> Path:
    """A Slurm recipe for the real trainer: `tiny` (mock data, CPU, fp32), one node. `python`: a fresh
    interpreter per process, or launch.trainer_python() where the test's claim allows."""
    recipe: dict[str, Any] = {
        "include": ["tiny"], "name": name,
        "run": {"root": str(tmp / "runs")},
        "cluster": {"backend": "slurm", "gpus_per_node": 0, "tasks_per_node": tasks_per_node, "cpus_per_task": 1,
                    "time": "00:03:00", "python": python, "megalaunch": job_cli(), "master_port": free_port(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": str(step_sleep_s), "OMP_NUM_THREADS": "1"}},
        "training": {"global_batch_size": GBS, "micro_batch_size": 1, "log_interval": 1},
        "logging": {"rank_output": "all"},  # every rank's decision lines in the log (default: rank 0's)
        # only the stop/trigger saves and Megatron's final save: every checkpoint is one we caused
        "checkpoint": {"save_interval": 1000000, "save_time_estimate_s": 10, "keep_last": 20},
        # lead = save 10 + step 2 + Slurm's 30 s check period + margin 18 = 60 s
        "chain": {"step_time_estimate_s": 2, "signal_margin_s": 18, "min_train_time_s": 30,
                  "trigger_interval": 1, "hang_timeout_s": 300,
                  "restarts_per_segment": 0},  # a failure ends the segment (test_restart_slurm.py: restarts on)
    }
    for key, value in sections.items():
        recipe.setdefault(key, {})
        recipe[key].update(value)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def _submit(tmp: Path, recipe: Path) -> Path:
    proc = megalaunch(None, "submit", str(recipe), cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return run_dir_of(tmp)


def _chain_done(run: Path) -> bool:
    return any(e["event"] == "chain_stopped" for e in ledger(run)) and not queue_ids(name=run.name)


def _events(run: Path, event: str) -> list[dict[str, Any]]:
    return [e for e in ledger(run) if e["event"] == event]


def _segment_log(run: Path, job_id: str) -> str:
    path = run / "logs" / f"{run.name}-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _iterations(log: str) -> list[tuple[int, int, float]]:
    """(iteration, consumed samples, lm loss) of every Megatron iteration line, in order."""
    return [(int(m.group(1)), int(m.group(3)), float(m.group(4))) for m in ITERATION_LINE.finditer(log)]


def _decisions(log: str) -> dict[int, list[tuple[str, int]]]:
    """Rank -> [(decision, iteration)] from the `[megalaunch rank R] decision D at iteration N` lines."""
    out: dict[int, list[tuple[str, int]]] = {}
    for m in DECISION_LINE.finditer(log):
        out.setdefault(int(m.group(1)), []).append((m.group(2), int(m.group(3))))
    return out


def _progress(run: Path) -> int:
    try:
        return int(json.loads((run / "state" / "progress.json").read_text())["iteration"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        return 0


def _tail(run: Path, job_id: str, n: int = 4000) -> str:
    return f"\n--- log of {job_id} (tail) ---\n{_segment_log(run, job_id)[-n:]}"


# --- >= 3 segments, each stopped by Slurm's time-limit warning ------------------------------------

# Periodic saves: 2-3 per segment of 28..57 iterations. The first save of a segment starts the
# checkpoint writer's processes (a multiprocessing Manager, the resource tracker); the signal save
# that comes later must survive the SIGUSR2 that Slurm sends them too.
SAVE_INTERVAL = 15


@pytest.mark.slow
@pytest.mark.timeout(CHAIN_TIMEOUT_S + 240)
def test_tiny_chain_with_periodic_saves_stops_on_time_limit_signal_and_resumes_exactly(slurm_tmp: Path) -> None:
    recipe = train_recipe(slurm_tmp, "trainchain", tasks_per_node=2, training={"train_iters": TRAIN_ITERS},
                          checkpoint={"save_interval": SAVE_INTERVAL})
    run = _submit(slurm_tmp, recipe)
    paths = RunPaths(run)
    slurm_states: dict[str, str] = {}  # recorded while the chain runs: slurmctld forgets after MinJobAge
    trigger_job: list[str] = []  # the segment that got a `trigger save` early on (the second one)

    def done() -> bool:
        for job in submitted_ids(run):
            if job not in slurm_states and (st := job_state(job)) in TERMINAL_STATES:
                slurm_states[job] = st
        started = _events(run, "started")
        if not trigger_job and len(started) == 2 and _progress(run) >= (started[1]["checkpoint_iteration"] or 0) + 3:
            _trigger(run, "save")
            trigger_job.append(started[1]["job_id"])
        return _chain_done(run)

    try:
        wait_for(done, CHAIN_TIMEOUT_S, interval=2, what="the chain to finish")
    finally:
        if not _chain_done(run):
            megalaunch(None, "cancel", str(run))
    ended = _events(run, "ended")
    started = _events(run, "started")
    decisions = _events(run, "decision")
    resumed = _events(run, "resumed")
    jobs = [e["job_id"] for e in ended]
    logs = {j: _segment_log(run, j) for j in jobs}
    report = "\n".join(f"segment {e['job_id']}: {e['outcome']} at {e['checkpoint_iteration']}" for e in ended)

    # >= 3 segments: all but the last saved on the signal, the last finished at the target
    assert len(ended) >= 3, report + _tail(run, jobs[-1])
    assert [e["outcome"] for e in ended] == ["saved"] * (len(ended) - 1) + ["finished"], report
    assert [e["job_id"] for e in started] == jobs  # one `started` per segment, in order
    assert trigger_job == [jobs[1]], (trigger_job, jobs)
    saves = [d for d in decisions if d["decision"] == "save"]
    decisions = [d for d in decisions if d["decision"] != "save"]
    assert [(d["job_id"], d["triggers"]) for d in saves] == [(jobs[1], ["save"])], saves
    # one stop decision per stopped segment; in the last, only a time-limit signal that came while it was
    # already finishing (its final save at TRAIN_ITERS: seen in CI when the third segment ended just then)
    in_last = [d for d in decisions if d["job_id"] == jobs[-1]]
    assert all(d["iteration"] == TRAIN_ITERS and d["decision"] == "signal" for d in in_last), in_last
    assert [d["job_id"] for d in decisions if d not in in_last] == jobs[:-1], decisions

    skipped: dict[str, set[int]] = {}
    for e in _events(run, "save_skipped"):
        assert e["reason"] == "inside the signal window", e  # the only skip a roomy disk may see
        skipped.setdefault(e["job_id"], set()).add(e["iteration"])
    stops: list[int] = []
    previous_end = 0
    previous_loss: float | None = None
    previous_samples = 0
    loss_at_1: float | None = None
    for i, (job, end) in enumerate(zip(jobs, ended, strict=True)):
        log = logs[job]
        its = _iterations(log)
        assert its, f"no Megatron iteration lines in segment {job}" + _tail(run, job)
        numbers = [it for it, _, _ in its]
        # both ranks ended on their own: rank 0's clean-up of its left-overs never kills rank 1, which
        # shares its process group (slurmstepd's) and may still be writing its part of the last save
        assert (end["exit_code"], end["first_failure"]) == (0, None), (job, end, _tail(run, job, 1500))
        assert {int(m.group(2)) for m in ITERATION_LINE.finditer(log)} == {TRAIN_ITERS}  # same target
        last = i == len(jobs) - 1
        stop = TRAIN_ITERS if last else decisions[i]["iteration"]
        # contiguous: starts right after the previous stop (no restart, no step repeated or skipped)
        assert numbers == list(range(previous_end + 1, stop + 1)), (job, numbers[:3], numbers[-3:], previous_end, stop)
        assert all(samples == it * GBS for it, samples, _ in its), (job, its[:3])  # consumed samples exact
        # the pacing hook works. Its sleep comes after an iteration's log line (before the decision), so a
        # segment's first logged interval holds none, and a short last segment (CI: 3 iterations, 111 / 596 /
        # 1089 ms) says little: the median of the later intervals, where there are at least 4
        elapsed = sorted(float(m.group(1)) for m in ELAPSED.finditer(log))
        paced = sorted(float(m.group(1)) for m in list(ELAPSED.finditer(log))[1:])
        if len(paced) >= 4:
            assert paced[len(paced) // 2] >= STEP_SLEEP_S * 1000, (job, elapsed[:5])
        if i == 0:
            loss_at_1 = its[0][2]
            assert started[0]["checkpoint_iteration"] is None and "starting from scratch" in log
        else:
            # resumes at exactly the previous stop, with the same consumed samples
            assert started[i]["checkpoint_iteration"] == previous_end
            (res,) = [r for r in resumed if r["job_id"] == job]
            assert (res["iteration"], res["consumed_samples"]) == (previous_end, previous_samples), res
            assert f"resumed at iteration {previous_end} with {previous_samples} consumed samples" in log
            # the loss continues: the first loss after the resume is close to the last one before (within
            # a fifth of the way back to the from-scratch loss of iteration 1, ~6.2 = ln 512, plus 0.1
            # for batch-to-batch noise: measured steps across a resume 0.03-0.15), not a restart
            first_loss = its[0][2]
            assert loss_at_1 is not None and previous_loss is not None
            tolerance = 0.2 * (loss_at_1 - previous_loss) + 0.1
            assert abs(first_loss - previous_loss) <= tolerance, (job, previous_loss, first_loss, loss_at_1)
            assert first_loss < loss_at_1 - 0.5, (job, first_loss, loss_at_1)
            print(f"segment {job}: loss {previous_loss:.4f} at {previous_end}, {first_loss:.4f} at "
                  f"{previous_end + 1} after the resume (iteration 1: {loss_at_1:.4f})")
        # periodic saves at every multiple of SAVE_INTERVAL trained here (Megatron skips the one that
        # would repeat the stop save), plus the trigger's save in the second segment
        # that did not fall inside the signal window (skipped there, recorded: the stop save takes its place)
        periodic = [it for it in range(previous_end + 1, stop + 1)
                    if it % SAVE_INTERVAL == 0 and it != stop and it not in skipped.get(job, set())]
        extra = [saves[0]["iteration"]] if job in trigger_job else []
        own_saves = sorted({*periodic, *extra})
        if not last:
            # stopped by Slurm's time-limit warning: the signal decision on both ranks, a save at that
            # iteration after the periodic ones, and it exited before the limit (COMPLETED, not TIMEOUT)
            d = decisions[i]
            assert (d["decision"], d["signal"], d["triggers"]) == ("signal", True, []), d
            expected = {r: [*(("save", saves[0]["iteration"]) for _ in extra), ("signal", stop)] for r in (0, 1)}
            assert _decisions(log) == expected, job
            assert [int(m.group(1)) for m in SAVED_LINE.finditer(log)] == [*own_saves, stop], job + _tail(run, job)
            assert "Broken pipe" not in log and "Traceback" not in log, job + _tail(run, job)
            assert (end["checkpoint_iteration"], end["new_checkpoint"]) == (stop, True), end
            assert (slurm_states.get(job) or wait_job_done(job, 60)) == "COMPLETED", (job, slurm_states)
            lead = 180 - (d["time"] - started[i]["time"])
            print(f"segment {job}: iterations {previous_end + 1}..{stop} ({stop - previous_end}), "
                  f"USR2 acted on ~{lead:.0f} s before the limit")
            stops.append(stop)
        else:
            # none, or the time-limit signal that came during its final save (see the decisions above)
            assert _decisions(log) in ({}, {r: [("signal", TRAIN_ITERS)] for r in (0, 1)}), (job, _decisions(log))
            assert [int(m.group(1)) for m in SAVED_LINE.finditer(log)] == [*own_saves, TRAIN_ITERS], job
            print(f"segment {job}: iterations {previous_end + 1}..{stop} ({stop - previous_end}), finished")
        previous_end, previous_samples, previous_loss = stop, its[-1][1], its[-1][2]

    # every stop left a complete checkpoint at its iteration, besides the periodic and trigger saves
    windowed = set().union(*skipped.values()) if skipped else set()
    expected_ckpts = sorted({*(set(range(SAVE_INTERVAL, TRAIN_ITERS + 1, SAVE_INTERVAL)) - windowed), *stops,
                             TRAIN_ITERS, saves[0]["iteration"]})
    assert checkpoint_iterations(paths) == expected_ckpts
    assert all(is_complete(paths, it) for it in expected_ckpts)
    assert paths.read_tracker() == TRAIN_ITERS
    outcome = json.loads(paths.outcome.read_text())
    assert (outcome["status"], outcome["iteration"], outcome["resumed_from"]) == ("finished", TRAIN_ITERS, stops[-1])
    # 0 jobs left: every segment and the successor queued by the last are gone or finished
    assert queue_ids(name=run.name) == []
    (stopped,) = _events(run, "chain_stopped")
    assert stopped["reason"] == f"training reached its target (iteration {TRAIN_ITERS})"
    for job in submitted_ids(run):
        assert (slurm_states.get(job) or wait_job_done(job, 60)) in {"COMPLETED", "CANCELLED"}, job
    assert set(stopped["cancelled"]) == set(submitted_ids(run)) - set(jobs)

    # goodput: each segment's components add up to its wall time, with the trainer's phases on Slurm
    from megalaunch.launcher.accounting.goodput import chain_goodput

    g = chain_goodput(paths, time.time())
    assert [seg["job_id"] for seg in g["segments"]] == jobs
    for seg in g["segments"]:
        parts = seg["parts"]
        assert abs(sum(parts.values()) - (seg["end"] - seg["start"])) < 1.0, seg
        assert parts["imports"] > 0 and parts["productive"] > 0 and parts["checkpoint_save"] > 0, seg
        assert parts["lost_work"] == 0 and parts["failed"] == 0, seg  # every stop saved where it stopped
    print(f"goodput {g['goodput']:.1%} of {g['wall']:.0f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in g["totals"].items()))


# --- triggers on 2 processes ------------------------------------------------------------------------

TRIGGERS = {"training": {"train_iters": 1000000}, "cluster": {"time": "00:10:00"}}
TRIGGER_STEP_SLEEP_S = 0.2


def _start_two_ranks(tmp: Path, name: str) -> tuple[Path, str, str]:
    """Submit a 2-process run (one node, DP=2); wait until it trains and its successor is queued."""
    recipe = train_recipe(tmp, name, tasks_per_node=2, step_sleep_s=TRIGGER_STEP_SLEEP_S, python=trainer_python(),
                          **TRIGGERS)
    run = _submit(tmp, recipe)
    wait_for(lambda: len(submitted_ids(run)) >= 2, 120, what="the successor to be queued")
    first, successor = submitted_ids(run)[:2]
    try:
        wait_for(lambda: _progress(run) >= 3, 180, what="iteration 3")
    except AssertionError as e:
        raise AssertionError(f"{e}{_tail(run, first)}") from None
    assert "world_size ...................................... 2" in _segment_log(run, first)
    return run, first, successor


def _trigger(run: Path, verb: str) -> None:
    proc = megalaunch(None, "trigger", verb, str(run), "--reason", f"test: {verb}")
    assert proc.returncode == 0, proc.stderr


def _both_ranks_acted(run: Path, job: str, decision: str) -> int:
    """Wait until ranks 0 and 1 both logged `decision D at iteration N`; assert the same N; return it."""
    def acted() -> dict[int, list[int]] | None:
        found = {r: [n for d, n in acts if d == decision] for r, acts in _decisions(_segment_log(run, job)).items()}
        return found if all(found.get(r) for r in (0, 1)) else None

    try:
        found = wait_for(acted, 120, what=f"both ranks acting on {decision}")
    except AssertionError as e:
        raise AssertionError(f"{e}{_tail(run, job)}") from None
    assert found[0] == found[1] and len(found[0]) == 1, found  # the same iteration on both ranks, once
    assert set(found) == {0, 1}, found
    return found[0][0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_save_then_exit_trigger_on_two_ranks(slurm_tmp: Path) -> None:
    run, first, successor = _start_two_ranks(slurm_tmp, "trainsave")
    paths = RunPaths(run)
    try:
        _trigger(run, "save")
        saved_at = _both_ranks_acted(run, first, "save")
        # a save: checkpoint written, job keeps running and training goes on
        wait_for(lambda: _progress(run) >= saved_at + 3, 120, what="training after the save")
        assert job_state(first) == "RUNNING"
        assert paths.read_tracker() == saved_at and is_complete(paths, saved_at)

        _trigger(run, "exit")
        exited_at = _both_ranks_acted(run, first, "exit")
        assert exited_at > saved_at
        assert wait_job_done(first, 120) == "COMPLETED"
        wait_for(lambda: not queue_ids(name=run.name), 60, what="the successor to be cancelled")
        assert wait_job_done(successor, 60) == "CANCELLED"
    finally:
        if queue_ids(name=run.name):
            megalaunch(None, "cancel", str(run))
    print(f"save acted on at iteration {saved_at}, exit at {exited_at} (ranks 0 and 1)")
    log = _segment_log(run, first)
    assert _decisions(log) == {r: [("save", saved_at), ("exit", exited_at)] for r in (0, 1)}
    assert [int(m.group(1)) for m in SAVED_LINE.finditer(log)] == [saved_at, exited_at]
    outcome = json.loads(paths.outcome.read_text())
    assert (outcome["status"], outcome["iteration"]) == ("exited", exited_at)
    assert checkpoint_iterations(paths) == [saved_at, exited_at] and is_complete(paths, exited_at)
    assert paths.read_tracker() == exited_at
    assert [(d["decision"], d["iteration"], d["triggers"]) for d in _events(run, "decision")] == [
        ("save", saved_at, ["save"]), ("exit", exited_at, ["exit"])]
    consumed = {(c["verb"], c["consumed_iteration"]) for c in TriggerBox(paths).consumed()}
    assert consumed == {("save", saved_at), ("exit", exited_at)}
    (stopped,) = _events(run, "chain_stopped")
    assert "exit trigger" in stopped["reason"] and stopped["cancelled"] == [successor]
    assert queue_ids(name=run.name) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_abort_trigger_on_two_ranks_writes_no_checkpoint(slurm_tmp: Path) -> None:
    run, first, successor = _start_two_ranks(slurm_tmp, "trainabort")
    paths = RunPaths(run)
    try:
        _trigger(run, "save")  # one checkpoint first, so "the abort wrote none" is observable
        saved_at = _both_ranks_acted(run, first, "save")
        wait_for(lambda: _progress(run) >= saved_at + 3, 120, what="training after the save")
        _trigger(run, "abort")
        aborted_at = _both_ranks_acted(run, first, "abort")
        assert aborted_at > saved_at
        assert wait_job_done(first, 120) == "COMPLETED"
        wait_for(lambda: not queue_ids(name=run.name), 60, what="the successor to be cancelled")
        assert wait_job_done(successor, 60) == "CANCELLED"
    finally:
        if queue_ids(name=run.name):
            megalaunch(None, "cancel", str(run))
    print(f"save acted on at iteration {saved_at}, abort at {aborted_at} (ranks 0 and 1)")
    log = _segment_log(run, first)
    assert _decisions(log) == {r: [("save", saved_at), ("abort", aborted_at)] for r in (0, 1)}
    assert [int(m.group(1)) for m in SAVED_LINE.finditer(log)] == [saved_at]  # no save on abort
    outcome = json.loads(paths.outcome.read_text())
    assert (outcome["status"], outcome["iteration"]) == ("aborted", aborted_at)
    assert checkpoint_iterations(paths) == [saved_at] and paths.read_tracker() == saved_at
    assert [(d["decision"], d["iteration"]) for d in _events(run, "decision")] == [
        ("save", saved_at), ("abort", aborted_at)]
    (stopped,) = _events(run, "chain_stopped")
    assert "abort" in stopped["reason"] and stopped["cancelled"] == [successor]
    assert queue_ids(name=run.name) == []


# --- one rank killed with SIGKILL -----------------------------------------------------------------

def _job_processes(job: str) -> dict[int, str]:
    """pid -> command line of every live process on this host that belongs to Slurm job `job`
    (the batch shell, the task supervisors, the trainers and everything they started)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[stat.rfind(")") + 2] != "Z" and f"SLURM_JOB_ID={job}".encode() in environ:
            out[int(entry.name)] = cmdline
    return out


def _trainer_pid(job: str, rank: int) -> int | None:
    for pid, cmd in _job_processes(job).items():
        if "megalaunch.runtime.train" in cmd and "megalaunch.runtime.task" not in cmd:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"SLURM_PROCID={rank}".encode() in environ:
                return pid
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_of_one_rank_ends_the_segment_promptly_and_status_names_its_node(slurm_tmp: Path) -> None:
    """2 nodes x 1 rank, periodic saves (so each rank has checkpoint-writer processes); rank 1 on node2
    is killed with SIGKILL: the segment ends within 15 s (no 60 s I/O abandon by slurmd), no process of
    the job is left, and the ended record and `status` name rank 1 on node2."""
    recipe = train_recipe(slurm_tmp, "killrank", step_sleep_s=0.2, training={"train_iters": 1000000},
                          cluster={"nodes": 2, "time": "00:10:00"}, checkpoint={"save_interval": 5})
    run = _submit(slurm_tmp, recipe)
    try:
        wait_for(lambda: len(submitted_ids(run)) >= 2, 120, what="the successor to be queued")
        first = submitted_ids(run)[0]
        wait_for(lambda: _progress(run) >= 12, 240, what="iteration 12 (two periodic saves)")
        victim = _trainer_pid(first, 1)
        assert victim is not None, _job_processes(first)
        before = _job_processes(first)
        assert len(before) >= 6, before  # batch shell, srun, 2 supervisors, 2 trainers and their helpers
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        state = wait_job_done(first, 30)
        ended_at = time.time()
        (end,) = [e for e in _events(run, "ended") if e["job_id"] == first]
        wait_for(lambda: not _job_processes(first), 15, what="every process of the job to be gone")
        left = {pid: cmd for pid, cmd in before.items() if Path(f"/proc/{pid}").exists()
                and (Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z")}
    finally:
        megalaunch(None, "cancel", str(run))
    print(f"rank 1 killed: job {state} after {ended_at - killed_at:.1f} s, `job end` after "
          f"{end['time'] - killed_at:.1f} s: {end['reason']}")
    assert end["time"] - killed_at < 15, end
    assert ended_at - killed_at < 15 + 1, (state, ended_at - killed_at)
    assert left == {}, left
    assert end["outcome"] == "failed" and end["reason"].startswith("rank 1 on node2 was killed by SIGKILL"), end
    assert (end["first_failure"]["rank"], end["first_failure"]["node"]) == (1, "node2"), end
    proc = megalaunch(None, "status", str(run))
    assert proc.returncode == 0, proc.stderr
    assert f"{first}" in proc.stdout and "rank 1 on node2 was killed by SIGKILL" in proc.stdout, proc.stdout
