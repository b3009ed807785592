"""`megalaunch status` at scale (issue 33; bench/status_scale.py times it): a listing of many runs asks Slurm
once, reads each run's backend and target from runtime.json (not its recipe) and only the lines of its
ledger that make its segments and stops; `status RUN` derives everything it shows from one read of the
ledger. What the selective read returns is exactly what a full read filtered by kind returns."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.status import LISTED_EVENTS, all_runs_status, run_status
from megalaunch.rundir import appended as appended_module
from megalaunch.rundir import ledger as ledger_module
from megalaunch.rundir.ledger import Ledger, event_name
from megalaunch.rundir.paths import RunPaths


def _runs(tmp_path: Path, n: int) -> list[RunPaths]:
    """`n` Slurm runs (copies of one written by megalaunch), each with a running segment and its queued
    successor; every third stopped (its successor cancelled by the chain, so still unfinished)."""
    first = write_run(prepare_run(load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", "cluster.backend=slurm"])))
    runs = [first]
    for i in range(1, n):
        dst = first.root.with_name(f"copy{i:03d}-{i:08x}")
        shutil.copytree(first.root, dst)
        runs.append(RunPaths(dst))
    for i, paths in enumerate(runs):
        ledger, job, succ = Ledger(paths), str(1000 + 2 * i), str(1001 + 2 * i)
        ledger.append("submitted", job_id=job, by="megalaunch submit")
        ledger.append("started", job_id=job, checkpoint_iteration=None, nodes="snode[1-4]", restart_count=None)
        ledger.append("submitted", job_id=succ, by=f"segment {job}", dependency="singleton")
        ledger.append("step_started", job_id=job, step=0, nodes="snode[1-4]", node_count=4, left_out={})
        ledger.append("health_check", job_id=job, healthy=True, ranks=[{"rank": 0, "event": "nested"}])
        if i % 3 == 2:
            ledger.append("ended", job_id=job, outcome="finished", checkpoint_iteration=10, new_checkpoint=True)
            ledger.append("chain_stopped", job_id=job, reason="training reached its target", cancelled=[succ])
    return runs


def _squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, running: list[str]) -> Path:
    """Slurm's client at the subprocess boundary: a squeue that logs its arguments and says `running` run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    lines = "".join(f"echo '{j}|x|RUNNING|None|me|1:00|snode1'\n" for j in running)
    (bin_dir / "squeue").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n{lines}')
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


def test_a_listing_of_many_runs_asks_slurm_once_and_reads_no_recipe(tmp_path: Path, monkeypatch) -> None:
    runs = _runs(tmp_path, 12)
    calls = _squeue(tmp_path, monkeypatch, running=["1000", "1004"])

    def no_recipe(paths: RunPaths) -> Any:
        raise AssertionError(f"the listing parsed {paths.run_yaml}")

    monkeypatch.setattr("megalaunch.config.loader.load_run_recipe", no_recipe)
    reads: list[Path] = []
    events = Ledger.events

    def counted(self: Ledger, only: Any = None, **kw: Any) -> list[dict[str, Any]]:
        reads.append(self.paths.ledger)
        return events(self, only, **kw)

    monkeypatch.setattr(Ledger, "events", counted)
    rows = {r["chain_name"]: r for r in all_runs_status(runs)}
    (query,) = calls.read_text().splitlines()  # one squeue for the unfinished segments of all the runs
    asked = query.split("-j ")[1].split(",")
    assert sorted(asked) == sorted([str(1000 + 2 * i) for i in range(12) if i % 3 != 2]
                                   + [str(1001 + 2 * i) for i in range(12)])
    assert sorted(reads) == sorted(p.ledger for p in runs)  # each ledger once
    assert len(rows) == 12
    assert rows[runs[0].root.name]["state"] == "running" and rows[runs[0].root.name]["jobs"] == ["1000"]
    assert rows[runs[1].root.name]["state"] == "idle"  # Slurm knows none of its jobs
    assert rows[runs[2].root.name]["state"] == "stopped"
    assert rows[runs[2].root.name]["stop_reason"] == "training reached its target"
    assert {r["target"] for r in rows.values()} == {json.loads(runs[0].runtime_json.read_text())["train_iters"]}
    # the next listing reuses what it read of every run whose files did not change (the user's cache)
    reads.clear()
    Ledger(runs[2]).append("chain_resumed", by="test")
    again = {r["chain_name"]: r for r in all_runs_status(runs)}
    assert reads == [runs[2].ledger] and again[runs[2].root.name]["state"] == "idle"
    assert {k: v for k, v in again.items() if k != runs[2].root.name} == {
        k: v for k, v in rows.items() if k != runs[2].root.name}


def test_a_run_whose_runtime_json_lacks_the_fields_is_listed_from_its_recipe(tmp_path: Path, monkeypatch) -> None:
    (paths,) = _runs(tmp_path, 1)
    _squeue(tmp_path, monkeypatch, running=[])
    settings = json.loads(paths.runtime_json.read_text())
    del settings["backend"]  # as a run made by an older megalaunch
    paths.runtime_json.write_text(json.dumps(settings))
    (row,) = all_runs_status([paths])
    assert row["target"] == settings["train_iters"] and row["state"] == "idle"
    paths.run_yaml.write_text("cluster: [\n")  # damaged: not listed
    assert all_runs_status([paths]) == []


def test_status_of_a_run_reads_its_ledger_once(tmp_path: Path, monkeypatch) -> None:
    (paths,) = _runs(tmp_path, 1)
    _squeue(tmp_path, monkeypatch, running=["1000"])
    # the goodput (launcher/accounting/goodput.chain_goodput) still reads the ledger on its own: not counted
    monkeypatch.setattr("megalaunch.launcher.accounting.pace.efficiency", lambda *a, **k: {"goodput": None})
    reads: list[str] = []
    read_jsonl, lines = ledger_module.read_jsonl, ledger_module._lines

    def counted(path: Any) -> list[dict[str, Any]]:
        reads.append(str(path))
        return read_jsonl(path)

    def counted_lines(p: RunPaths) -> list[str]:
        reads.append(str(p.ledger))
        return lines(p)

    appended = appended_module.read_appended

    def counted_appended(path: Any, *a: Any, **k: Any) -> list[dict[str, Any]]:
        if str(path) == str(paths.ledger):
            reads.append(str(path))
        return appended(path, *a, **k)

    monkeypatch.setattr(ledger_module, "read_jsonl", counted)
    monkeypatch.setattr(ledger_module, "_lines", counted_lines)
    monkeypatch.setattr(appended_module, "read_appended", counted_appended)
    st = run_status(paths)
    assert reads == [str(paths.ledger)]
    assert st["chain_state"] == "running" and [r["state"] for r in st["segments"]] == ["RUNNING", "GONE"]


@pytest.mark.parametrize("only", [LISTED_EVENTS.__contains__, lambda kind: kind != "started"])
def test_the_selective_read_is_the_full_read_filtered(tmp_path: Path, only: Any) -> None:
    paths = RunPaths(tmp_path)
    paths.ledger.parent.mkdir(parents=True)
    ledger = Ledger(paths)
    ledger.append("submitted", job_id="1", by="megalaunch submit")
    ledger.append("health_check", job_id="1", ranks=[{"event": "started"}])  # a nested "event" key
    ledger.append("started", job_id="1", note='say "event": "ended"')  # quotes inside a value
    ledger.append("trigger_refused", name='x"event": "ended', why="\\")
    with open(paths.ledger, "a") as f:
        f.write('{"event":"ended","job_id":"1","time":1}\n')  # not json.dumps's separators
        f.write('\n   \n[1, 2]\n"started"\n{"time": 2}\n')  # blank lines, not an object, no event
        f.write('{"event": "chain_stopped", "reason": "x", "time": 3}\n')
    ledger.append("health_check", job_id="2", ranks=[])
    with open(paths.ledger, "a") as f:
        f.write('{"time": 4,  "event":"health_check", "job_id": "3"}\n')  # the newest, named only once parsed
        f.write('{"event": "ended", "job_id": "2", "ti')  # torn last line
    full = ledger.events()
    assert ledger.events(only) == [e for e in full if only(e.get("event"))]
    # of the kinds `newest` names, the newest N events only; the rest as they were
    newest = max(i for i, e in enumerate(full) if e.get("event") == "health_check")
    assert ledger.events(newest={"health_check": 1}) == [
        e for i, e in enumerate(full) if e.get("event") != "health_check" or i == newest]
    assert ledger.events(skip=frozenset({"started", "ended"}), newest={"health_check": 1}) == [
        e for i, e in enumerate(full)
        if e.get("event") not in ("started", "ended") and (e.get("event") != "health_check" or i == newest)]
    assert ledger.events(only, newest={"health_check": 1}) == [
        e for i, e in enumerate(full) if only(e.get("event")) and (e.get("event") != "health_check" or i == newest)]
    # cached (rundir/appended.py): the same selection, also after more lines were appended
    sel = {"skip": frozenset({"started"}), "newest": {"health_check": 1}}
    with open(paths.ledger, "a") as f:
        f.write('\n')  # ends the torn line: it stays unparseable, the next ones are whole
    assert ledger.events(**sel, cache_key="test") == ledger.events(**sel)
    ledger.append("health_check", job_id="4", ranks=[])
    ledger.append("started", job_id="4")
    assert ledger.events(**sel, cache_key="test") == ledger.events(**sel)
    assert ledger.events(**sel, cache_key="test")[-1]["job_id"] == "4"
    full = ledger.events()
    twos = [i for i, e in enumerate(full) if e.get("event") == "health_check"][-2:]
    assert ledger.events(newest={"health_check": 2}) == [
        e for i, e in enumerate(full) if e.get("event") != "health_check" or i in twos]
    assert [e["event"] for e in ledger.events(LISTED_EVENTS.__contains__)] == [
        "submitted", "started", "ended", "chain_stopped", "started"]


def test_event_name() -> None:
    assert event_name(json.dumps({"event": "ended", "job_id": "1"}, sort_keys=True)) == "ended"
    assert event_name(json.dumps({"a": {"event": "x"}, "event": "ended"}, sort_keys=True)) is None  # two: parse
    assert event_name('{"event":"ended"}') is None  # another writer's separators: parse
    assert event_name(json.dumps({"event": 'a"b'})) is None
    assert event_name(json.dumps({"note": 'x "event": "ended"'})) is None  # no key, a quoted value
    assert event_name('{"event": "ended') is None  # torn


def test_parse_jsonl_takes_what_a_line_by_line_parse_takes() -> None:
    """The one-array parse falls back line by line wherever the lines do not make exactly one value each."""
    import json

    from megalaunch.rundir.files import parse_jsonl

    def by_line(lines: list[str]) -> list[Any]:
        out = []
        for line in lines:
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                out.append(value)
        return out

    cases = [
        ['{"event": "a"}', "", "  ", '{"event": "b", "x": [1, 2]}'],
        ['{"event": "a", "x": [1', '2]}', '{"event": "c"}'],  # a torn line and its remains
        ['{"event": "a"}', "[1, 2]", "3", '"s"', '{"event": "b"}'],  # values that are not objects
        ['{"event": "a"}', '{"event": "b"', '{"event": "c"}'],  # a torn last-but-one line
        ['1, 2', '{"event": "a"}'],  # a line of two values
        [],
    ]
    for lines in cases:
        assert parse_jsonl(lines) == by_line([line.strip() for line in lines if line.strip()]), lines
