"""Plan and submit a tokenization: the run directory, the job-array script, the Slurm and local
backends. Submitting again submits only the dumps that are not done, so it is also "resume"."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.config.cluster import BACKENDS
from megalaunch.errors import PreflightError, RunDirError
from megalaunch.launcher.backends.local import pid_alive
from megalaunch.rundir.files import atomic_write_json, atomic_write_text
from megalaunch.rundir.tokenize import TokenizeRun
from megalaunch.tokenization.plan import Plan, load_plan, make_plan
from megalaunch.tokenization.recipe import TokenizeRecipe, load_run_recipe

RUN_DIR_MODE = 0o2750  # the owner writes, the group reads (docs/security.md)


def create_run(recipe: TokenizeRecipe, run_dir: str | os.PathLike[str]) -> tuple[TokenizeRun, Plan]:
    """Check the recipe against the world (inputs, tokenizer, output dir), plan the dumps and
    write the run directory. Re-planning an existing run is allowed only if the plan is unchanged."""
    import yaml

    from megalaunch.config.typed import to_plain

    check_tokenizer(recipe)
    plan = make_plan(recipe.inputs, recipe.n_dumps, recipe.tasks)
    run = TokenizeRun(Path(run_dir).expanduser().absolute())
    if run.plan_json.exists():
        from megalaunch.rundir.files import read_json

        if read_json(run.plan_json) != plan.to_json():
            raise RunDirError(f"{run.root} already holds a different plan (inputs or n_dumps changed)",
                              fix="use a new --run-dir, or `megalaunch tokenize submit` to resume this one")
    run.root.mkdir(parents=True, exist_ok=True, mode=RUN_DIR_MODE)
    for sub in (run.logs, run.ledger.parent, run.dumps):
        sub.mkdir(exist_ok=True)
    check_output_dir(run.output_dir(recipe.output_dir))
    atomic_write_text(run.recipe_yaml, yaml.safe_dump(to_plain(recipe), sort_keys=False))
    atomic_write_json(run.plan_json, plan.to_json())
    return run, plan


def check_tokenizer(recipe: TokenizeRecipe) -> None:
    """The tokenizer is a local file, its BOS/EOS exist (when `tokenizers` is installed here)."""
    import importlib.util

    from megalaunch.tokenization.encoder import check_tokenizer_file, load_encoder

    check_tokenizer_file(recipe.tokenizer.path)
    if importlib.util.find_spec("tokenizers") is not None:
        load_encoder(recipe.tokenizer.path, bos=recipe.tokenizer.bos, eos=recipe.tokenizer.eos)


def check_output_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PreflightError(f"cannot create output directory {path}: {e.strerror}", field="output_dir",
                             fix="choose a writable output_dir") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PreflightError(f"output directory {path} is not writable", field="output_dir",
                             fix="choose a writable output_dir or fix its permissions")


# -- what is left to do ------------------------------------------------------------------------
def pending_dumps(run: TokenizeRun, plan: Plan) -> list[int]:
    """Dumps without a summary (not completed and checked)."""
    return [d.index for d in plan.dumps if not run.summary(d.index).exists()]


def array_spec(indices: list[int], throttle: int | None = None) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' (+ '%K')."""
    parts: list[str] = []
    start = prev = None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:  # type: ignore[operator]
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts) + (f"%{throttle}" if throttle else "")


@dataclass(frozen=True)
class Submission:
    backend: str
    dumps: tuple[int, ...]
    job_id: str | None = None  # the array's job id (slurm)


def active_submission(run: TokenizeRun, slurm: Any | None = None) -> str | None:
    """The job id of a previous submission that still has tasks queued or running, if any."""
    events = run.events()
    submitted = [i for i, e in enumerate(events) if e.get("event") == "submitted"]
    if not submitted:
        return None
    last = events[submitted[-1]]
    if last.get("job_id"):  # a Slurm job array
        from megalaunch.launcher.backends.slurm import SlurmClient

        client = slurm or SlurmClient()
        jobs = client.squeue([last["job_id"]])
        return last["job_id"] if any(j.active for j in jobs.values()) else None
    if any(e.get("event") == "finished" for e in events[submitted[-1]:]):
        return None
    pid = last.get("pid")
    if pid and pid_alive(int(pid)) and last.get("host") == os.uname().nodename:
        return f"pid {pid}"
    return None




# -- slurm ------------------------------------------------------------------------------------
def render_job_script(run: TokenizeRun, recipe: TokenizeRecipe) -> str:
    from megalaunch import __version__
    from megalaunch.launcher.prepare.render import render
    from megalaunch.launcher.prepare.sbatch import JobHeader, sbatch_options

    slurm = recipe.slurm
    options = sbatch_options(slurm.partition, slurm.account, slurm.qos, extra=slurm.options, field_prefix="slurm.options",
                             reserved={"reservation", "constraint"})  # no fields of their own here
    job = JobHeader(name=f"tok-{recipe.name}", log=str(run.logs / "%x-%A_%a.out"),
                    log_from="the run directory (tokenize plan --run-dir)", time=slurm.time,
                    cpus_per_task=recipe.concurrent_workers, mem=slurm.mem, options=options)
    return render("tokenize.sbatch.j2", version=__version__, run_dir=str(run.root), job=job,
                  setup=list(slurm.setup), python=slurm.python or sys.executable)


def submit_slurm(run: TokenizeRun, dumps: list[int], recipe: TokenizeRecipe, slurm: Any | None = None) -> Submission:
    from megalaunch.launcher.backends.slurm import SlurmClient

    client = slurm or SlurmClient()
    atomic_write_text(run.job_script, render_job_script(run, recipe))
    spec = array_spec(dumps, recipe.slurm.max_concurrent)
    job_id = client.sbatch(run.job_script, [f"--array={spec}"], cwd=run.root)
    run.record("submitted", backend="slurm", job_id=job_id, dumps=dumps, array=spec)
    return Submission("slurm", tuple(dumps), job_id)


# -- local ------------------------------------------------------------------------------------
def run_local(run: TokenizeRun, dumps: list[int], recipe: TokenizeRecipe) -> Submission:
    """The same plan on this machine: the dumps one after another, each in its own process running
    the same entry point as an array task, its log in RUN/logs. Stops at the first failed dump."""
    run.record("submitted", backend="local", pid=os.getpid(), host=os.uname().nodename, dumps=dumps)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    python = recipe.slurm.python or sys.executable
    try:
        for dump in dumps:
            _run_local_dump(run, dump, python, env)
    finally:
        run.record("finished", backend="local", pid=os.getpid())
    return Submission("local", tuple(dumps))


def _run_local_dump(run: TokenizeRun, dump: int, python: str, env: dict[str, str]) -> None:
    log = run.logs / f"local-dump_{dump:04d}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.out"
    with open(log, "ab") as out:
        proc = subprocess.run([python, "-m", "megalaunch.tokenization.job", str(run.root), "--dump", str(dump)],
                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    run.record("ended", backend="local", dump=dump, returncode=proc.returncode, log=str(log))
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
        raise PreflightError(f"dump {dump} failed (exit {proc.returncode}): {tail[0]}",
                             fix=f"see {log}; fix, then `megalaunch tokenize submit {run.root}` resumes")


def submit(run: TokenizeRun, *, backend: str | None = None, dumps: list[int] | None = None,
           slurm: Any | None = None) -> Submission | None:
    """Submit every dump that is not done (or the given ones). None when nothing is left to do."""
    recipe = load_run_recipe(run)
    plan = load_plan(run)
    backend = backend or recipe.backend
    todo = pending_dumps(run, plan)
    if dumps is not None:
        unknown = sorted(set(dumps) - {d.index for d in plan.dumps})
        if unknown:
            raise PreflightError(f"dumps {unknown} are not in the plan", field="--dump",
                                 valid=f"0..{len(plan.dumps) - 1}")
        todo = [d for d in todo if d in set(dumps)]
    if not todo:
        return None
    queued = BACKENDS[backend].job_script  # Slurm: a job array; local: the dumps run here, one by one
    active = active_submission(run, slurm if queued else None) if run.events() else None
    if active:
        raise RunDirError(f"a previous submission ({active}) is still queued or running; two jobs must not "
                          "write the same dump", fix=f"wait, or `megalaunch tokenize cancel {run.root}`")
    check_tokenizer(recipe)
    if queued:
        return submit_slurm(run, todo, recipe, slurm)
    return run_local(run, todo, recipe)


def cancel(run: TokenizeRun, slurm: Any | None = None) -> str | None:
    """Cancel the last Slurm submission by its job id (never by name)."""
    from megalaunch.launcher.backends.slurm import SlurmClient

    events = [e for e in run.events() if e.get("event") == "submitted" and e.get("job_id")]
    if not events:
        return None
    job_id = events[-1]["job_id"]
    (slurm or SlurmClient()).scancel([job_id])
    run.record("cancelled", job_id=job_id)
    return str(job_id)
