"""A job that dies before megalaunch starts in it is seen (issue #50): the job script runs the megalaunch
that submitted it (or the recipe's, checked at submit), and `status` names a newest segment that ended
without a `job begin` record as failed, with its job id, Slurm's state and the end of its log, not "idle".
Slurm is faked at the subprocess boundary (squeue, scontrol on PATH)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.errors import ConfigError
from megalaunch.launcher.prepare import self_cli
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.status import run_status
from megalaunch.launcher.status_format import format_run_status
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


# ----------------------------------------------------------------- the megalaunch the job runs
def test_the_submitting_console_script_is_found_by_absolute_path(tmp_path: Path, monkeypatch) -> None:
    script = _exe(tmp_path / "venv" / "bin" / "megalaunch")
    monkeypatch.setattr(sys, "argv", [str(script), "submit"])
    assert self_cli.submitting_megalaunch() == str(script)
    # `python -m megalaunch.cli.main` from a venv: the console script beside its interpreter
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "main.py")])
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    assert self_cli.submitting_megalaunch() == str(script)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "elsewhere" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert self_cli.submitting_megalaunch() is None


def test_a_slurm_job_script_runs_the_submitting_megalaunch_quoted(tmp_path: Path, monkeypatch) -> None:
    script = _exe(tmp_path / "my venv" / "bin" / "megalaunch")  # a space: the script must quote it
    monkeypatch.setattr(self_cli, "submitting_megalaunch", lambda: str(script))
    prepared = prepare_run(load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", "cluster.backend=slurm"]))
    assert f"megalaunch_cli='{script}'\n" in prepared.files["job.sbatch"]
    assert prepared.recipe.cluster.megalaunch == str(script)
    run_yaml = prepared.files["run.yaml"]  # recorded for the run's later jobs (eval, conversion)
    assert any(x.strip().startswith("megalaunch:") and str(script) in x and self_cli.ORIGIN in x
               for x in run_yaml.splitlines()), run_yaml
    self_cli.check_job_megalaunch(prepared.recipe)  # an executable file: accepted
    # a recipe that names one keeps it
    named = prepare_run(load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", "cluster.backend=slurm",
                                             "cluster.megalaunch=/opt/site/bin/megalaunch"]))
    assert "megalaunch_cli=/opt/site/bin/megalaunch\n" in named.files["job.sbatch"]
    with pytest.raises(ConfigError, match="not an executable file") as e:
        self_cli.check_job_megalaunch(named.recipe)  # checked at submit: it does not exist here
    assert e.value.field == "cluster.megalaunch"
    bare = prepare_run(load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", "cluster.backend=slurm",
                                            "cluster.megalaunch=megalaunch"]))
    self_cli.check_job_megalaunch(bare.recipe)  # a command name: looked up in the job's environment
    local = prepare_run(load_recipe("tiny", [f"run.root={tmp_path / 'runs'}"]))
    assert local.recipe.cluster.megalaunch == "megalaunch"  # the local backend runs no job script


# ----------------------------------------------------------------------- status of a vanished job
def _slurm(tmp_path: Path, monkeypatch, *, squeue: str = "", scontrol: str | None = None) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{squeue}\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\n" + (f"echo '{scontrol}'\n" if scontrol else
                                                       "echo 'slurm_load_jobs error: Invalid job id' >&2; exit 1\n"))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def _run(tmp_path: Path) -> RunPaths:
    paths = write_run(prepare_run(load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", "cluster.backend=slurm"])))
    Ledger(paths).append("submitted", job_id="4242", by="megalaunch submit")
    return paths


def test_a_job_that_died_at_its_first_line_is_failed_with_its_log(tmp_path: Path, monkeypatch) -> None:
    paths = _run(tmp_path)
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.segment_log("4242").write_text("".join(f"module line {i}\n" for i in range(50))
                                         + "/var/spool/slurmd/job4242/slurm_script: line 50: megalaunch: "
                                           "command not found\n\n")
    _slurm(tmp_path, monkeypatch, scontrol="JobId=4242 JobName=tiny JobState=FAILED Reason=NonZeroExitCode")
    st = run_status(paths)
    assert st["chain_state"] == "failed"
    assert st["vanished"]["job_id"] == "4242" and st["vanished"]["slurm_state"] == "FAILED"
    assert len(st["vanished"]["log_tail"]) == 3 and st["vanished"]["log_tail"][-1].endswith("command not found")
    (row,) = st["segments"]
    assert row["state"] == "FAILED" and "Slurm: FAILED" in row["reason"] and "command not found" in row["reason"]
    text = format_run_status(st)
    assert "chain: failed" in text and "chain: idle" not in text
    assert "segment 1 (job 4242) ended before megalaunch started in it (Slurm: FAILED)" in text
    assert "    | module line 49" in text and "module line 46" not in text  # the last lines only
    assert f"megalaunch resume {paths.root}" in text


def test_a_job_slurm_forgot_and_without_a_log_is_still_named(tmp_path: Path, monkeypatch) -> None:
    paths = _run(tmp_path)
    _slurm(tmp_path, monkeypatch)  # squeue lists nothing, scontrol no longer knows the job
    st = run_status(paths)
    assert st["chain_state"] == "failed" and st["vanished"]["slurm_state"] is None
    text = format_run_status(st)
    assert "(job 4242)" in text and "Slurm: state unknown" in text and "no log at" in text


def test_queued_or_stopped_at_begin_is_not_vanished(tmp_path: Path, monkeypatch) -> None:
    paths = _run(tmp_path)
    _slurm(tmp_path, monkeypatch, squeue="echo '4242|tiny|PENDING|Priority|me|0:00|'")
    st = run_status(paths)
    assert st["chain_state"] == "queued" and st["vanished"] is None
    Ledger(paths).append("chain_stopped", job_id="4242", reason="abort trigger pending at segment start")
    (tmp_path / "bin" / "squeue").write_text("#!/bin/sh\n")  # the job ended after `job begin` stopped the chain
    st = run_status(paths)
    assert st["chain_state"] == "stopped" and st["vanished"] is None
