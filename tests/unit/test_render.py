"""Rendered job scripts: golden files for every shipped training recipe x Slurm cluster profile,
`bash -n` and shellcheck on each, and hostile recipe strings rendered into inert scripts.

Regenerate the golden files after an intended change with MEGALAUNCH_UPDATE_GOLDEN=1 (and read the diff)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.recipe_files import shipped_recipes
from megalaunch.launcher.prepare.prepare import prepare_run

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TRAIN = sorted(k.split("/")[1] for k in shipped_recipes() if k.startswith("train/"))
SLURM_CLUSTERS = ["slurm", "pyxis", "cscs", "modules"]
COMBOS = [(r, c) for r in TRAIN for c in SLURM_CLUSTERS]


def render_combo(recipe: str, cluster: str) -> str:
    loaded = load_recipe(recipe, cluster=cluster)
    prepared = prepare_run(loaded, chain_name=f"{loaded.recipe.name}-00000000", created="2026-01-01T00:00:00",
                           root=Path("/runs"))
    return prepared.files["job.sbatch"]


SELF_CLI = "/opt/venv/bin/megalaunch"  # stands for the submitting megalaunch (launcher/prepare/self_cli.py)


@pytest.fixture(autouse=True)
def _fixed_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/user")  # ~ is expanded at render time
    monkeypatch.setattr("megalaunch.launcher.prepare.self_cli.submitting_megalaunch", lambda: SELF_CLI)


@pytest.mark.parametrize(("recipe", "cluster"), COMBOS, ids=[f"{r}-{c}" for r, c in COMBOS])
def test_golden_script(recipe: str, cluster: str, tmp_path: Path) -> None:
    script = render_combo(recipe, cluster)
    golden = GOLDEN / f"{recipe}.{cluster}.sbatch"
    if os.environ.get("MEGALAUNCH_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(script)
    assert golden.exists(), f"no golden file {golden}; run with MEGALAUNCH_UPDATE_GOLDEN=1"
    assert script == golden.read_text(), f"{golden.name} changed; if intended, regenerate (see module doc)"
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_every_golden_file_has_a_combo() -> None:
    expected = {f"{r}.{c}.sbatch" for r, c in COMBOS}
    present = {p.name for p in GOLDEN.glob("*.sbatch")}
    assert present == expected, f"stale golden files: {present - expected}; missing: {expected - present}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (CI installs it)")
def test_shellcheck_all_golden_scripts() -> None:
    files = sorted(str(p) for p in GOLDEN.glob("*.sbatch"))
    assert files
    proc = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_signal_lead_and_chain_directives() -> None:
    script = render_combo("llama3-8b", "slurm")
    # save 120 + step 10 + Slurm's 30 s check + margin 60
    assert "#SBATCH --signal=USR2@220\n" in script
    assert "#SBATCH --no-requeue\n" in script
    assert "#SBATCH --job-name=llama3-8b-00000000\n" in script
    assert "#SBATCH --output=/runs/llama3-8b-00000000/logs/%x-%j.out\n" in script
    assert "#SBATCH --gpus-per-node=8\n" in script and "#SBATCH --ntasks-per-node=8\n" in script


def test_spare_nodes_keep_the_job_alive_when_a_node_dies() -> None:
    """With spares, a node that dies must not end the job (Slurm's default on node failure): --no-kill
    keeps it on the others, where the step loop restarts on a spare (docs/scale.md); a restarted step
    overlaps the dead step Slurm keeps RUNNING."""
    assert "--no-kill" not in render_combo("llama3-8b", "slurm")
    loaded = load_recipe("llama3-8b", ["cluster.spare_nodes=2"], cluster="slurm")
    script = prepare_run(loaded, chain_name="x-00000000", created="2026-01-01T00:00:00", root=Path("/runs")).files[
        "job.sbatch"]
    assert "#SBATCH --no-kill\n" in script and f"#SBATCH --nodes={loaded.recipe.cluster.nodes + 2}\n" in script
    assert 'srun --kill-on-bad-exit=1 "${step_args[@]}" ' in script and "  step_args=(--overlap)\n" in script
    # the keeper's step carries the name by which `job watch` leaves it (and its srun) alone
    from megalaunch.runtime.health.slurm_step import KEEPER_STEP

    assert f"setsid srun --overlap --job-name={KEEPER_STEP} " in script
    assert "MEGALAUNCH_STEP_NODES=$step_nodes" in script  # the step's nodes, for `job watch`'s node loss


def test_header_explains_no_requeue_next_to_auto_requeue() -> None:
    """The recipe says chain.auto_requeue: true and the script says --no-requeue: the header, above the
    #SBATCH lines, says why (issue 15)."""
    script = render_combo("tiny", "slurm")
    header = script[:script.index("#SBATCH")]
    assert "--no-requeue below is on purpose, also with chain.auto_requeue" in header
    assert "same job id" in header and "--dependency=singleton" in header
    assert all(line.startswith("#") for line in header.splitlines())


HOSTILE = ["$(touch {pwn})", "`touch {pwn}`", "'; touch {pwn}; '", '"; touch {pwn}; "', "a;touch {pwn}",
           "x\ntouch {pwn}\n", "$HOME ${{PATH}} \\$(x) *", "--flag=\"$(touch {pwn})\""]


def _stub(bindir: Path, name: str, body: str) -> None:
    f = bindir / name
    f.write_text("#!/bin/bash\n" + body + "\n")
    f.chmod(f.stat().st_mode | stat.S_IEXEC)


def test_hostile_strings_render_into_inert_scripts(tmp_path: Path) -> None:
    """Run the rendered script for real with stand-ins for srun/scontrol/module/megalaunch that record
    their arguments: no hostile string runs, each arrives as one literal argument or value."""
    pwn = tmp_path / "PWNED"
    hostile = [h.format(pwn=pwn) for h in HOSTILE]
    venv = tmp_path / hostile[0]  # a directory literally named "$(touch ...)"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("export ACTIVATED=yes\n")
    recipe = tmp_path / "r.yaml"
    import yaml

    recipe.write_text(yaml.safe_dump({
        "include": ["tiny"], "name": "hostile", "run": {"root": str(tmp_path / "runs")},
        "description": hostile[5],
        "workload": ["/bin/echo", *hostile],
        "cluster": {"backend": "slurm", "gpus_per_node": 0, "venv": str(venv), "modules": hostile[:3],
                    "env": {f"V{i}": h for i, h in enumerate(hostile)}, "time": "00:10:00",
                    "megalaunch": "megalaunch"},  # the stand-in on PATH below
        "megatron_args": {"note": hostile[0]},
    }))
    loaded = load_recipe(str(recipe))
    prepared = prepare_run(loaded, chain_name="hostile-00000000", created=hostile[5], root=tmp_path / "runs")
    script = tmp_path / "job.sbatch"
    script.write_text(prepared.files["job.sbatch"])
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        sc = subprocess.run(["shellcheck", "--shell=bash", "--exclude=SC2016", str(script)], capture_output=True, text=True)
        assert sc.returncode == 0, sc.stdout  # SC2016 says single quotes do not expand: the point
    bindir = tmp_path / "bin"
    bindir.mkdir()
    rec = tmp_path / "rec"
    rec.mkdir()
    # srun waits (10 s at most) for the hang watcher started beside it, so its call is recorded before
    # the script stops it
    _stub(bindir, "srun", f'printf "%s\\0" "$@" > {rec}/srun.argv\nenv -0 > {rec}/srun.env\n'
                          f'for _ in $(seq 200); do grep -q "^job watch" {rec}/megalaunch.calls && break; sleep 0.05; done')
    _stub(bindir, "scontrol", "echo node1")
    _stub(bindir, "module", f'printf "%s\\0" "$@" >> {rec}/module.argv')
    _stub(bindir, "megalaunch", f'echo "$@" >> {rec}/megalaunch.calls\n'
                                'if [ "$2" = step-nodes ]; then echo node1; fi')
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1",
           "SLURM_NNODES": "1", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not pwn.exists(), "a hostile string was executed"
    srun_argv = (rec / "srun.argv").read_text().split("\0")[:-1]
    assert srun_argv[-len(hostile) - 1:] == ["/bin/echo", *hostile]
    srun_env = dict(kv.split("=", 1) for kv in (rec / "srun.env").read_text().split("\0") if "=" in kv)
    for i, h in enumerate(hostile):
        if "\n" not in h:  # env -0 keeps newlines, but the split above is per NUL: compare all
            assert srun_env[f"V{i}"] == h
    assert srun_env["ACTIVATED"] == "yes"
    module_argv = (rec / "module.argv").read_text().split("\0")[:-1]
    assert module_argv == [x for h in hostile[:3] for x in ("load", h)]
    calls = (rec / "megalaunch.calls").read_text().splitlines()
    run_dir = str(tmp_path / "runs" / "hostile-00000000")
    assert calls[0] == f"job begin {run_dir}" and calls[1] == f"job step-nodes {run_dir} --step 0", calls
    assert re.fullmatch(rf"job watch {re.escape(run_dir)} --shell-pid \d+", calls[2]), calls
    assert calls[3] == f"job step-end {run_dir} --step 0 --exit-code 0" and calls[4].startswith("job end "), calls
    assert srun_env["MASTER_ADDR"] == "node1" and srun_env["WORLD_SIZE"] == "1", srun_env
    assert "--nodelist=node1" in srun_argv and "--nodes=1" in srun_argv and "--ntasks=1" in srun_argv


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (CI installs it)")
def test_shellcheck_repo_scripts() -> None:
    repo = GOLDEN.parents[1]
    files = [repo / ".ci" / "run", repo / ".ci" / "slurm-up", repo / ".ci" / "slurm-down",
             repo / "scripts" / "demo", repo / "scripts" / "test", repo / "scripts" / "_env.sh"]
    proc = subprocess.run(["shellcheck", "-x", "-P", "SCRIPTDIR", *map(str, files)], capture_output=True, text=True,
                          cwd=repo)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_debug_options_render_valid_scripts(tmp_path: Path) -> None:
    loaded = load_recipe("llama3-8b", ["debug.nccl_debug=true", "debug.flight_recorder=true", "debug.nsys=true",
                                       "debug.nsys_start_offset=10", "debug.nsys_iters=5"])
    script = prepare_run(loaded, chain_name="dbg-00000000", created="T", root=Path("/runs")).files["job.sbatch"]
    assert "export NCCL_DEBUG_FILE=/runs/dbg-00000000/debug/nccl-%h-%p.log" in script
    assert "export TORCH_NCCL_DUMP_ON_TIMEOUT=1" in script
    assert "nsys profile --capture-range=cudaProfilerApi" in script
    # the nsys window is in Megatron's arguments, relative to the iteration each segment resumes from
    args = prepare_run(loaded, chain_name="dbg-00000000", created="T", root=Path("/runs")).files["megatron.args"]
    assert "--profile\n--profile-step-start\n10\n--profile-step-end\n15\n" in args
    settings = json.loads(prepare_run(loaded, chain_name="dbg-00000000", created="T",
                                      root=Path("/runs")).files["runtime.json"])
    assert settings["profile_window"] is True
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck"):
        sc = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True)
        assert sc.returncode == 0, sc.stdout


def test_code_snapshot_copies_tracked_files_and_fails_loudly(tmp_path: Path) -> None:
    from megalaunch.errors import PreflightError
    from megalaunch.launcher.prepare.write import write_run

    src = tmp_path / "src"
    src.mkdir()
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    (src / "train.py").write_text("print('hi')\n")
    (src / "untracked.txt").write_text("x\n")
    subprocess.run(["git", "-C", str(src), "add", "train.py"], check=True)
    loaded = load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", f"debug.code_snapshot={src}"])
    paths = write_run(prepare_run(loaded))
    assert (paths.code_snapshot / "train.py").read_text() == "print('hi')\n"
    assert not (paths.code_snapshot / "untracked.txt").exists()
    missing = load_recipe("tiny", [f"run.root={tmp_path / 'runs2'}", f"debug.code_snapshot={tmp_path / 'nope'}"])
    with pytest.raises(PreflightError, match=r"debug\.code_snapshot"):
        write_run(prepare_run(missing))
    assert not any((tmp_path / "runs2").glob("*"))  # nothing half-written
