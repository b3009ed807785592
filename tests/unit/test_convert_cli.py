"""`megalaunch convert` wiring: help, errors as one line, and --submit's rendered job script."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from typer.testing import CliRunner

from megalaunch.cli import convert
from megalaunch.config.loader import load_recipe

from .helpers import cli


class FakeSlurm:
    calls: ClassVar[list[tuple[Path, Any]]] = []

    def sbatch(self, script: Path, extra_args: Any = (), *, cwd: Path | None = None, env: Any = None) -> str:
        FakeSlurm.calls.append((script, cwd))
        return "4242"


@pytest.fixture
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> type[FakeSlurm]:
    import megalaunch.launcher.backends.slurm as slurm

    FakeSlurm.calls = []
    monkeypatch.setattr(slurm, "SlurmClient", FakeSlurm)
    return FakeSlurm


def check_script(script: Path) -> str:
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        res = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout
    return text


def test_help_lists_both_directions() -> None:
    res = CliRunner().invoke(convert.app, ["--help"])
    assert res.exit_code == 0 and "hf-to-mcore" in res.output and "mcore-to-hf" in res.output


def test_hf_to_mcore_submit_renders_and_submits(tmp_path: Path, fake_slurm: type[FakeSlurm]) -> None:
    hf = tmp_path / "my model $(touch pwned)"
    hf.mkdir()
    out = tmp_path / "out"
    res = CliRunner().invoke(convert.app, ["hf-to-mcore", str(hf), "--recipe", "tiny", "--out", str(out),
                                           "--set", "training.lr=1e-4", "--submit", "--time", "00:30:00"])
    assert res.exit_code == 0, res.output
    assert "submitted conversion job 4242" in res.output
    script = out / "convert.sbatch"
    assert fake_slurm.calls == [(script, out)]
    text = check_script(script)
    assert "#SBATCH --time=00:30:00" in text and "#SBATCH --ntasks=1" in text
    assert "#SBATCH --gpus-per-node" not in text  # the tiny recipe's cluster has no GPUs
    assert f"#SBATCH --output={out}/logs/%x-%j.out" in text
    assert f"megalaunch convert hf-to-mcore '{hf}' --out {out} --recipe tiny" in text
    assert "--no-progress --set training.lr=1e-4" in text and "--submit" not in text.split("#SBATCH")[-1]
    assert f"when it has finished, next: megalaunch submit tiny --set checkpoint.load={out}\n" in res.output
    assert not (tmp_path / "pwned").exists()


def test_mcore_to_hf_submit_takes_the_run_recipe(tmp_path: Path, fake_slurm: type[FakeSlurm]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    recipe = load_recipe("tiny", ["cluster.gpus_per_node=4", "cluster.partition=gpu", "cluster.venv=/opt/venv"])
    (run / "run.yaml").write_text(yaml.safe_dump(recipe.resolved()))
    res = CliRunner().invoke(convert.app, ["mcore-to-hf", str(run), "--out", str(tmp_path / "hf"), "--iteration",
                                           "50", "--submit"])
    assert res.exit_code == 0, res.output
    text = check_script(tmp_path / "hf" / "convert.sbatch")
    assert f"when it has finished, next: AutoModelForCausalLM.from_pretrained('{tmp_path / 'hf'}')" in res.output
    assert "#SBATCH --gpus-per-node=1" in text and "#SBATCH --partition=gpu" in text
    assert "source -- /opt/venv/bin/activate" in text
    assert f"megalaunch convert mcore-to-hf {run} --out {tmp_path / 'hf'} --iteration 50" in text


@pytest.mark.parametrize(("args", "message"), [
    (["mcore-to-hf", "/nonexistent", "--out", "/tmp/x", "--family", "gpt2"], "--family: unknown family 'gpt2'"),
    (["mcore-to-hf", "/nonexistent", "--out", "/tmp/x", "--max-shard-size", "lots"], "--max-shard-size"),
    (["mcore-to-hf", "/nonexistent", "--out", "/tmp/x", "--submit"], "--submit needs the cluster settings"),
    (["hf-to-mcore", "/nonexistent", "--out", "/tmp/x", "--set", "a=1"], "--set needs --recipe"),
])
def test_bad_arguments_fail_with_one_line(args: list[str], message: str) -> None:
    res = cli("convert", *args)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_max_shard_size_units() -> None:
    assert convert._bytes("5GB") == 5_000_000_000
    assert convert._bytes("2GiB") == 2 * 2**30
    assert convert._bytes("500MB") == 500_000_000
    assert convert._bytes("1024") == 1024
