"""The same property for the other job scripts: tokenization's job array (every string field of the
tokenization recipe) and a conversion job (the training recipe's cluster fields and the `megalaunch
convert` command line, both free text): refused with a megalaunch error, or inert, with every value
delivered byte for byte."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from tests.property.fields import CANARY, PLAIN, StringField, hostile_text, merge, override, string_fields
from tests.property.recipes import expected_header, home, sbatch_lines, write_recipe
from tests.property.sandbox import STUBS, Sandbox
from tests.property.test_job_scripts import sandboxed

from megalaunch.config.loader import load_recipe
from megalaunch.errors import MegalaunchError
from megalaunch.rundir.tokenize import TokenizeRun
from megalaunch.tokenization.recipe import TokenizeRecipe, load_tokenize_recipe

# slurm.setup is documented as shell lines run before the job (module load ..., source ...): it is
# meant to be interpreted, so it is not arbitrary text here.
TOKENIZE_FIELDS = [f for f in string_fields(TokenizeRecipe) if f.path != "slurm.setup"]
PER_FIELD = max(settings().max_examples // 4, 5)


def _bash_n(script: str) -> None:
    assert "\0" not in script
    syntax = subprocess.run(["/bin/bash", "-n"], input=script.encode(), capture_output=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr


def _run(box: Sandbox, script: str) -> subprocess.CompletedProcess[bytes]:
    before = {p for d in (box.work, box.home, box.bin) for p in d.rglob("*")}
    proc = box.run(script)
    note(proc.stderr.decode(errors="replace"))
    assert not CANARY.exists(), "a value was interpreted by the shell"
    assert {p for d in (box.work, box.home, box.bin) for p in d.rglob("*")} == before, "the script created files"
    return proc


@pytest.mark.parametrize("field", TOKENIZE_FIELDS, ids=str)
@settings(max_examples=PER_FIELD)
@given(text=hostile_text)
def test_tokenize_field_is_refused_or_renders_an_inert_script(field: StringField, text: str) -> None:
    from megalaunch.tokenization.submit import render_job_script

    with sandboxed() as box:
        # the compute nodes' interpreter is a stand-in unless it is the field under test
        tree = merge({"include": ["tokenize/jsonl"], "slurm": {"python": "python3"}}, override(field, text))
        try:
            recipe = load_tokenize_recipe(str(write_recipe(box.root / "tok.yaml", tree)))[0]
            run = TokenizeRun(box.root / "tokrun")
            script = render_job_script(run, recipe)
        except MegalaunchError:
            return
        note(script)
        _bash_n(script)
        s = recipe.slurm
        named = [(k, getattr(s, k)) for k in ("partition", "account", "qos")]
        options = [{"name": k, "value": str(v)} for k, v in named if v]
        options += [{"name": k, "value": v} for k, v in sorted(s.options.items())]
        job = type("Job", (), dict(name=f"tok-{recipe.name}", nodes=1, ntasks_per_node=None,
                                   cpus_per_task=recipe.concurrent_workers, gpus_per_node=0, mem=s.mem, time=s.time,
                                   options=options, exclusive=False, signal=None, append=False,
                                   log=str(run.logs / "%x-%A_%a.out")))
        assert sbatch_lines(script) == expected_header(job)
        python = s.python  # quoted, not expanded: the job's shell runs exactly this
        if not python:  # documented default: the interpreter running megalaunch (not run here)
            assert f"exec -- {shlex.quote(sys.executable)} -m megalaunch.tokenization.job " in script
            return
        log = python if python in STUBS else "custom"
        has_python = box.make_command(python)
        proc = _run(box, script)
        if not has_python:
            assert proc.returncode in (126, 127), proc.stderr
            return
        assert proc.returncode == 0, proc.stderr
        assert box.calls(log) == [["-m", "megalaunch.tokenization.job", str(run.root)]]


CLUSTER_FIELDS = [f for f in string_fields(__import__("megalaunch.config.schema", fromlist=["Recipe"]).Recipe)
                  if f.path.startswith("cluster.")]


@pytest.mark.parametrize("field", CLUSTER_FIELDS, ids=str)
@settings(max_examples=max(PER_FIELD // 2, 4))
@given(text=hostile_text, args=st.lists(hostile_text, max_size=3), out=st.one_of(PLAIN, hostile_text),
       profile=st.sampled_from(["slurm", "pyxis", "cscs", "modules"]))
def test_convert_job_is_refused_or_inert(field: StringField, text: str, args: list[str], out: str,
                                         profile: str) -> None:
    from megalaunch.conversion.submit import render_script
    from megalaunch.launcher.prepare.sbatch import cluster_options
    from megalaunch.rundir.paths import ConversionPaths

    with sandboxed() as box:
        tree = merge({"include": ["tiny", f"clusters/{profile}"], "name": "conv"}, override(field, text))
        try:
            recipe = load_recipe(str(write_recipe(box.root / "r.yaml", tree))).recipe
            out_dir = (box.root / "out" / out) if "\0" not in out else Path(out)
            command = ["hf-to-mcore", *args, "--out", str(out_dir)]
            script = render_script(recipe, command, out_dir)
        except (MegalaunchError, ValueError) as e:
            if isinstance(e, ValueError) and "\0" not in out:  # only a NUL in a path is a ValueError here
                raise
            return
        note(script)
        _bash_n(script)
        cl = recipe.cluster
        job = type("Job", (), dict(name=f"convert-{recipe.name}", nodes=1, ntasks_per_node=None,
                                   cpus_per_task=cl.cpus_per_task, gpus_per_node=1, mem=cl.mem, time=cl.time,
                                   options=cluster_options(cl), exclusive=False, signal=None, append=False,
                                   log=str(ConversionPaths(out_dir).logs / "%x-%j.out")))
        assert sbatch_lines(script) == expected_header(job)
        activated = True
        if cl.venv:
            activated = box.make_file(str(Path(home(cl.venv)) / "bin" / "activate"), "export MLPROP_ACTIVATED=yes\n")
        proc = _run(box, script)
        if not activated:
            assert proc.returncode != 0 and not box.calls("srun")
            return
        assert proc.returncode == 0, proc.stderr
        srun_args: list[Any] = []
        co = cl.container
        if co.kind == "pyxis":
            srun_args = [f"--container-image={co.image}", f"--container-mounts={','.join([f'{out_dir}:{out_dir}', *co.mounts])}"]
            srun_args += [f"--container-workdir={co.workdir}"] if co.workdir else []
        elif co.kind == "cscs":
            srun_args = [f"--environment={home(co.environment or '')}"]
        assert box.calls("srun") == [["--ntasks=1", *srun_args, home(cl.megalaunch), "convert", *command]]
        assert box.calls("module") == [["load", m] for m in cl.modules]
        env = box.srun_env()
        for k, v in cl.env.items():
            assert env.get(k) == v, k
