"""Every node's sign of life apart from training progress (runtime/health/node_beat.py): the decision over
what the beat files hold, the writer thread, the task supervisor's beat, the hang watcher ending a step whose
node went silent (the line `job step-end` reads), and the keeper ending a job whose batch host went silent.
The real thing, a node frozen on the scale cluster: tests/slurm/test_frozen_node_slurm.py."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.unit.test_hangwatch import LIMITS, FakeClock, FakeSlurm, _paths

from megalaunch.launcher.accounting.evidence import NODE_LOST, abnormal_ends, lost_nodes
from megalaunch.launcher.backends.keeper import keep
from megalaunch.launcher.backends.slurm import JobInfo
from megalaunch.runtime.hangwatch import SlurmStep, watch
from megalaunch.runtime.health.heartbeat import Heartbeat
from megalaunch.runtime.health.node_beat import (
    HostSilence,
    NodeBeat,
    NodeSilence,
    StepSilence,
    beat_dir,
    silence_s,
)

NODES = ["n1", "n2", "n3"]


def _beats(t: float, nodes: list[str], seq: dict[str, int]) -> dict[str, bytes | None]:
    """What the files hold at `t` when `nodes` beat then (the others keep their last content)."""
    for n in nodes:
        seq[n] = seq.get(n, 0) + 1
    return {n: (f"{n} {seq[n]}".encode() if n in seq else None) for n in NODES}


def test_a_node_that_stops_beating_while_the_others_beat_is_lost_after_the_silence() -> None:
    d, seq = NodeSilence(silence_s=15, fresh_s=5, never_s=45), {}
    d.observe(0.0, _beats(0.0, [], seq))  # the baseline: nothing of this step yet
    t = 0.0
    while t < 10:
        t += 2
        d.observe(t, _beats(t, NODES, seq))
        assert d.silent(t, NODES) == []
    while t < 24:  # n2 froze after its beat at t=10
        t += 2
        d.observe(t, _beats(t, ["n1", "n3"], seq))
        assert d.silent(t, NODES) == [], t
    d.observe(25.0, _beats(25.0, ["n1", "n3"], seq))
    assert d.silent(25.0, NODES) == ["n2"] and "silent for 15 s" in d.why(25.0, "n2")


def test_a_slow_node_an_idle_step_and_a_stall_of_most_nodes_are_not_losses() -> None:
    d, seq = NodeSilence(silence_s=15, fresh_s=5, never_s=45), {}
    d.observe(0.0, _beats(0.0, [], seq))
    for i in range(1, 60):  # n2 beats every 12 s only (a loaded node): slow, never 15 s silent
        t = float(i)
        d.observe(t, _beats(t, ["n1", "n3"] + (["n2"] if i % 12 == 0 else []), seq))
        assert d.silent(t, NODES) == [], t
    # then nobody beats (the step ended; the file system stalled): nobody is judged
    assert d.silent(200.0, NODES) == []
    # four nodes, three silent at once while one beats: the file system or the judge, not three dead nodes
    four = NodeSilence(silence_s=15, fresh_s=5)
    four.observe(0.0, {})
    four.observe(1.0, {"a": b"1", "b": b"1", "c": b"1", "d": b"1"})
    four.observe(20.0, {"a": b"2", "b": b"1", "c": b"1", "d": b"1"})
    assert four.silent(20.0, ["a", "b", "c", "d"]) == []


def test_a_file_from_before_the_judge_is_no_beat_and_a_node_that_never_beats_is_lost_later() -> None:
    d = NodeSilence(silence_s=15, fresh_s=5, never_s=45)
    d.observe(0.0, {"n1": b"old", "n2": b"old", "n3": None})  # an earlier step's files
    for i in range(1, 50):
        d.observe(float(i), {"n1": f"new {i}".encode(), "n2": b"old", "n3": f"new {i}".encode()})
        lost = d.silent(float(i), NODES)
        assert lost == ([] if i < 46 else ["n2"]), (i, lost)  # first beat at 1 s: 45 s later
    assert "never beat" in d.why(49.0, "n2")


def test_a_node_whose_writer_said_it_ended_is_never_silent() -> None:
    """Its work is over (its ranks ended) while its peers may still write their last checkpoint."""
    d = NodeSilence(silence_s=15, fresh_s=5, never_s=45)
    d.observe(0.0, {})
    d.observe(1.0, {"n1": b"1", "n2": b"1"})
    for t in range(2, 40):
        d.observe(float(t), {"n1": f"{t}".encode(), "n2": b'{"seq": 2, "ended": true}'})
        assert d.silent(float(t), ["n1", "n2"]) == []


def test_an_earlier_steps_last_word_does_not_excuse_a_node_that_never_beats_in_this_one() -> None:
    d = NodeSilence(silence_s=15, fresh_s=5, never_s=45)
    d.observe(0.0, {"n1": b"old", "n2": b'{"seq": 9, "ended": true}'})  # step 0's files
    for t in range(1, 50):
        d.observe(float(t), {"n1": f"{t}".encode(), "n2": b'{"seq": 9, "ended": true}'})
    assert d.silent(49.0, ["n1", "n2"]) == ["n2"]


def test_a_large_step_is_read_less_often_and_still_judged(tmp_path: Path) -> None:
    nodes = [f"n{i}" for i in range(256)]
    step = StepSilence(tmp_path, nodes, silence=15)
    assert step.every == 4.0 and step.decision.fresh_s >= step.every + 2
    reads: list[float] = []
    real = step.decision.observe
    step.decision.observe = lambda now, beats: (reads.append(now), real(now, beats))[1]  # type: ignore[method-assign]
    for t in range(0, 60):
        for n in nodes[:-1] if t >= 10 else nodes:  # the last node froze 10 s in
            (tmp_path / f"{n}.json").write_text(f"{t}")
        lost = step.check(float(t))
        if lost:
            break
    assert lost == ["n255"] and 25 <= t <= 33, t
    assert all(b - a >= 4.0 for a, b in itertools.pairwise(reads))


def test_the_writer_thread_beats_and_the_judge_finds_the_one_that_stopped(tmp_path: Path) -> None:
    a, b = NodeBeat(tmp_path, "a", "test", 0.05).start(), NodeBeat(tmp_path, "b", "test", 0.05).start()
    step = StepSilence(tmp_path, ["a", "b"], silence=0.5)
    step.decision.fresh_s = 0.3
    assert step.check(time.monotonic()) == []  # the baseline: both may have beaten already
    deadline = time.monotonic() + 20
    while set(step.decision._changed) != {"a", "b"} and time.monotonic() < deadline:  # both beat since it
        step.check(time.monotonic())
        time.sleep(0.02)
    b._stop.set()  # b's thread stops beating without a last word (a frozen node's)
    deadline = time.monotonic() + 20
    while not (lost := step.check(time.monotonic())) and time.monotonic() < deadline:
        time.sleep(0.05)
    a.stop()
    assert lost == ["b"]
    record = json.loads((tmp_path / "a.json").read_text())
    assert record["node"] == "a" and record["seq"] > 5 and record["by"] == "test" and record["ended"] is True
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_the_silence_comes_from_the_environment_with_a_floor() -> None:
    assert silence_s({}) == 15.0
    assert silence_s({"MEGALAUNCH_NODE_SILENCE_S": "6"}) == 6.0
    assert silence_s({"MEGALAUNCH_NODE_SILENCE_S": "1"}) == 6.0  # at least three beats
    assert silence_s({"MEGALAUNCH_NODE_SILENCE_S": "soon"}) == 15.0


def test_the_supervisor_of_a_nodes_first_task_beats_while_its_command_runs(tmp_path: Path) -> None:
    env = {**os.environ, "MEGALAUNCH_RUN_DIR": str(tmp_path), "MEGALAUNCH_JOB_ID": "9", "SLURMD_NODENAME": "n7",
           "MEGALAUNCH_STEP_NODES": "n7,n8", "SLURM_LOCALID": "0", "RANK": "3", "MEGALAUNCH_STEP": "1"}
    beat = beat_dir(tmp_path, "9") / "n7.json"
    script = f"import os, time\nwhile not os.path.exists({str(beat)!r}): time.sleep(0.01)\ntime.sleep(2.5)"
    p = subprocess.run([sys.executable, "-m", "megalaunch.runtime.task", "--", sys.executable, "-c", script],
                       env=env, timeout=60, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    record = json.loads(beat.read_text())
    assert record["node"] == "n7" and record["by"] == "task supervisor" and record["seq"] >= 2 and record["step"] == "1"
    # another task of the node, or a step of one node: no second writer, no beat at all
    for extra in ({"SLURM_LOCALID": "1", "SLURMD_NODENAME": "n9"}, {"MEGALAUNCH_STEP_NODES": "n9", "SLURMD_NODENAME": "n9"}):
        subprocess.run([sys.executable, "-m", "megalaunch.runtime.task", "--", "true"], env={**env, **extra},
                       timeout=60, check=True)
        assert not (beat_dir(tmp_path, "9") / "n9.json").exists()


def test_job_watch_ends_a_step_whose_node_went_silent_and_job_step_end_blames_it(tmp_path: Path, monkeypatch,
                                                                                 capsys) -> None:
    paths = _paths(tmp_path)
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "42")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    Heartbeat(paths, "42", enabled=True).beat("iteration")
    log = paths.segment_log("42")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    directory = beat_dir(paths.root, "42")
    directory.mkdir(parents=True)
    slurm, clock = FakeSlurm(answer=True), FakeClock()
    silence = StepSilence(directory, NODES, silence=15)
    beats = {n: NodeBeat(directory, n, "test") for n in NODES}

    def sleep(s: float) -> None:  # every node beats every second but n2, which froze after 3 s
        clock.sleep(s)
        for n, b in beats.items():
            if n != "n2" or clock.now < 1003:
                b.beat()

    started = clock()
    how = watch(paths, "42", LIMITS, SlurmStep("42", os.getpid(), run=slurm), clock=clock, sleep=sleep,
                silence=silence)
    assert how.startswith("cancelled step 42.0") and 17 <= clock() - started <= 19  # 3 s + the silence + a tick
    assert [c for c in slurm.calls if c[0] == "scancel"] == [["scancel", "42.0"]]
    lines = capsys.readouterr().err
    assert "node lost: n2 (silent for 15 s while the other nodes beat: frozen" in lines, lines
    (lost,) = [json.loads(x) for x in paths.ledger.read_text().splitlines() if '"step_nodes_lost"' in x]
    assert lost["nodes"] == ["n2"] and lost["why"][0].startswith("silent for 15 s"), lost
    with open(log, "a") as f:
        f.write(lines)
    ends = abnormal_ends(paths, "42", log)
    assert ends[0].rank == NODE_LOST and ends[0].node == "n2" and "silent while the other nodes beat" in ends[0].how, ends
    assert lost_nodes(log) == ["n2"]


def test_the_keeper_ends_the_job_when_its_batch_host_goes_silent_without_waiting_for_slurm(tmp_path: Path) -> None:
    clock = FakeClock()
    host, other = NodeBeat(tmp_path, "snode1", "hang watcher"), NodeBeat(tmp_path, "snode4", "task supervisor")
    asked: list[float] = []
    done: list[str] = []

    def ask(job: str) -> JobInfo:  # Slurm still lists the host: with its defaults it would for minutes
        asked.append(clock.now)
        return JobInfo(job_id="7", name="x", state="RUNNING", reason="", nodes="snode[1-4]", batch_host="snode1")

    def sleep(s: float) -> None:
        clock.sleep(s)
        other.beat()
        if clock.now < 1010:  # the batch host froze 10 s in
            host.beat()

    got = keep("7", "snode1", ask=ask, on_lost=lambda why: done.append(f"recorded: {why}"),
               cancel=lambda j: done.append(f"scancel {j}"), poll_s=5, sleep=sleep,
               silence=HostSilence(tmp_path, "snode1", "snode4", silence=15), clock=clock)
    assert got == "silent" and 1024 <= clock.now <= 1026, clock.now  # its last beat at 1009 + 15 s
    assert done[0].startswith("recorded: silent for 15 s") and done[1:] == ["scancel 7"], done
    assert len(asked) <= (clock.now - 1000) / 5 + 1  # Slurm asked every 5 s, the beats every second
