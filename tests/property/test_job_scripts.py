"""Property: every string field of the training recipe, set to arbitrary text the way users set it
(a YAML recipe file or `--set`), is either refused with one of megalaunch's own errors, or renders a
job script that passes `bash -n`, runs inertly under recording stand-ins for every command it calls
(nothing interpreted, nothing created outside the sandbox), and delivers every value byte for byte
(#SBATCH lines, srun's argv and environment, module and megalaunch calls, RUN/megatron.args)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st
from tests.property.fields import (
    CANARY,
    StringField,
    expected_text,
    hostile_text,
    merge,
    override,
    string_fields,
    typed_value,
)
from tests.property.recipes import expected_header, home, sbatch_lines, set_expr, write_recipe
from tests.property.sandbox import STUBS, Sandbox

from megalaunch.config.loader import load_recipe, parse_set
from megalaunch.config.megatron_args import megatron_args
from megalaunch.config.preflight import signal_lead_s
from megalaunch.config.schema import Recipe
from megalaunch.errors import MegalaunchError
from megalaunch.launcher.prepare.job_inputs import job_command, task_supervisor
from megalaunch.launcher.prepare.prepare import PreparedRun, prepare_run
from megalaunch.rundir.files import read_args_file

RECIPE_FIELDS = string_fields(Recipe)
SLURM_PROFILES = ["slurm", "pyxis", "cscs", "modules"]
PROFILES = [*SLURM_PROFILES, "local"]  # local: no job script, but RUN/megatron.args all the same
# Each field gets its own test; the profile's example budget is shared out among them.
PER_FIELD = max(settings().max_examples // 4, 5)


def profiles_for(field: StringField) -> list[str]:
    if field.path.startswith("cluster.container."):  # only a container profile puts these into the script
        return ["cscs"] if field.path.endswith(".environment") else ["pyxis"]
    return PROFILES


@contextlib.contextmanager
def sandboxed() -> Iterator[Sandbox]:
    """A fresh sandbox per example; HOME and the cwd point into it while the recipe is loaded and
    rendered (`~` is expanded at render time, relative run roots are relative to the cwd)."""
    with tempfile.TemporaryDirectory(prefix="mlprop-") as tmp, pytest.MonkeyPatch.context() as mp:
        box = Sandbox(Path(tmp))
        mp.setenv("HOME", str(box.home))
        mp.chdir(box.work)
        yield box


def load_with(box: Sandbox, field: StringField, text: str, route: str, profile: str) -> Any:
    """A user's recipe on top of the shipped tiny one and a Slurm cluster profile (included, so the
    recipe's own values win), with `text` in the recipe file or in a `--set`."""
    base: dict[str, Any] = {"include": ["tiny", f"clusters/{profile}"], "name": "prop",
                            "run": {"root": str(box.root / "runs")}}
    if route == "yaml":
        path = write_recipe(box.root / "recipe.yaml", merge(base, override(field, text)))
        return load_recipe(str(path))
    expr = set_expr(field, text, raw=route == "set-raw")
    assume(expr is not None)
    path = write_recipe(box.root / "recipe.yaml", base)
    return load_recipe(str(path), [expr])


def script_files(box: Sandbox) -> set[Path]:
    return {p for d in (box.work, box.home, box.bin) for p in d.rglob("*")}


def expected_train_header(prepared: PreparedRun) -> list[str]:
    r = prepared.recipe
    cl = r.cluster
    named = [(k, getattr(cl, k)) for k in ("partition", "account", "qos", "reservation", "constraint")]
    options = [{"name": k, "value": str(v)} for k, v in named if v]
    options += [{"name": k, "value": v} for k, v in sorted(cl.sbatch_extra.items())]
    job = SimpleNamespace(name=prepared.chain_name, nodes=cl.nodes, ntasks_per_node=cl.ntasks_per_node,
                          cpus_per_task=cl.cpus_per_task, gpus_per_node=cl.gpus_per_node, mem=cl.mem, time=cl.time,
                          options=options, exclusive=cl.exclusive,
                          signal=f"{r.chain.stop_signal.removeprefix('SIG')}@{signal_lead_s(r)}", append=True,
                          log=str(prepared.paths.logs / "%x-%j.out"))
    return expected_header(job)


def srun_container_args(r: Recipe, run_dir: str) -> list[str]:
    co = r.cluster.container
    if co.kind == "pyxis":
        args = [f"--container-image={co.image}", f"--container-mounts={','.join([f'{run_dir}:{run_dir}', *co.mounts])}"]
        return args + ([f"--container-workdir={co.workdir}"] if co.workdir else [])
    if co.kind == "cscs":
        return [f"--environment={home(co.environment or '')}"]
    return []


def check_args_file(box: Sandbox, prepared: PreparedRun) -> None:
    """RUN/megatron.args, read as the job reads it, is exactly the argument list."""
    path = box.root / "megatron.args"
    path.write_text(prepared.files["megatron.args"])
    assert read_args_file(path) == megatron_args(prepared.recipe, prepared.paths)


def run_train_script(box: Sandbox, prepared: PreparedRun) -> None:
    r = prepared.recipe
    cl = r.cluster
    script = prepared.files["job.sbatch"]
    note(script)
    assert "\0" not in script
    syntax = subprocess.run(["/bin/bash", "-n"], input=script.encode(), capture_output=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    assert sbatch_lines(script) == expected_train_header(prepared)

    run_dir = str(prepared.paths.root)
    activated = True
    if cl.venv:
        activated = box.make_file(os.path.join(home(cl.venv), "bin", "activate"), "export MLPROP_ACTIVATED=yes\n")
    cli = home(cl.megalaunch)
    cli_log = cli if cli in STUBS else "custom"
    has_cli = box.make_command(cli)
    before = script_files(box)
    proc = box.run(script)
    note(proc.stderr.decode(errors="replace"))
    assert not CANARY.exists(), "a value was interpreted by the shell"
    assert script_files(box) == before, "the script created files"
    if not activated or not has_cli:  # the venv or the megalaunch command names nothing in the sandbox
        assert proc.returncode != 0 and not box.calls("srun")
        return
    assert proc.returncode == 0, proc.stderr
    calls = box.calls(cli_log)
    # the hang watcher runs in the background and may be stopped before its stub records the call
    # (tests/unit/test_render.py waits for it); when recorded, it is this exact argv
    watch = [c for c in calls if c[:2] == ["job", "watch"]]
    assert [c for c in calls if c not in watch] == [
        ["job", "begin", run_dir], ["job", "step-nodes", run_dir, "--step", "0"],
        ["job", "step-end", run_dir, "--step", "0", "--exit-code", "0"], ["job", "end", run_dir, "--exit-code", "0"]]
    assert all(c[:4] == ["job", "watch", run_dir, "--shell-pid"] and len(c) == 5 and c[4].isdigit() for c in watch), watch
    assert box.calls("module") == [["load", m] for m in cl.modules]
    supervisor = task_supervisor(r)
    # the step's size is the node list `job step-nodes` printed (the stub: node1)
    expected = ["--kill-on-bad-exit=1", "--nodes=1", "--nodelist=node1", f"--ntasks={cl.ntasks_per_node}",
                f"--ntasks-per-node={cl.ntasks_per_node}",
                *srun_container_args(r, run_dir), *supervisor, *job_command(r, prepared.paths)]
    assert box.calls("srun") == [expected]
    env = box.srun_env()
    assert env["MEGALAUNCH_RUN_DIR"] == run_dir and env["MEGALAUNCH_JOB_ID"] == "4242"
    for k, v in cl.env.items():
        assert env.get(k) == v, k
    if cl.venv:
        assert env.get("MLPROP_ACTIVATED") == "yes"


@pytest.mark.parametrize("field", RECIPE_FIELDS, ids=str)
@settings(max_examples=PER_FIELD)
@given(data=st.data(), text=hostile_text, route=st.sampled_from(["yaml", "set", "set-raw"]))
def test_string_field_is_refused_or_renders_an_inert_script(field: StringField, data: Any, text: str,
                                                            route: str) -> None:
    profile = data.draw(st.sampled_from(profiles_for(field)), label="profile")
    with sandboxed() as box:
        try:
            loaded = load_with(box, field, text, route, profile)
        except MegalaunchError:
            return
        if route != "set-raw":  # the loader keeps the text as written (path fields: expanded once)
            assert typed_value(field, loaded.recipe, text) == expected_text(field, text)
        try:
            prepared = prepare_run(loaded, created="2026-01-01T00:00:00")
        except MegalaunchError:
            return
        check_args_file(box, prepared)
        if "job.sbatch" in prepared.files:
            run_train_script(box, prepared)


def test_every_string_field_is_enumerated() -> None:
    """The walk finds the fields this file was written against (and so any added since)."""
    paths = {f.path for f in RECIPE_FIELDS}
    assert {"name", "description", "cluster.env", "cluster.modules", "cluster.container.mounts", "cluster.venv",
            "cluster.sbatch_extra", "workload", "megatron_args", "data.blend[0].path", "run.root"} <= paths
    assert parse_set("a.b=1")[0] == ["a", "b"]
