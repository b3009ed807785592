"""The CLI stays light on login nodes: importing it loads none of the heavy libraries."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ["torch", "megatron", "transformers", "datatrove", "wandb", "numpy", "tokenizers", "safetensors",
         "matplotlib"]


def test_cli_import_pulls_in_no_heavy_library() -> None:
    code = ("import sys, megalaunch.cli.main; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"


def test_help_of_every_subcommand_is_light() -> None:
    code = ("import sys\nfrom megalaunch.cli.main import app\nimport typer.testing\n"
            "r = typer.testing.CliRunner()\n"
            "for args in (['--help'], ['submit','--help'], ['status','--help'], ['report','--help'], ['recipes','list'],"
            " ['tokenize','--help'], ['data','--help'], ['convert','--help']):\n"
            "    res = r.invoke(app, args)\n    assert res.exit_code == 0, (args, res.output)\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"


@pytest.mark.parametrize("argv", [["submit"], ["submit", "tiny", "--nodes", "4"], ["trigger", "halt", "RUN"]])
def test_usage_errors_are_short_without_click(argv: list[str]) -> None:
    """The error boundary needs no `click` module (typer 0.28 vendors its own): block it and see."""
    code = ("import sys; sys.modules['click'] = None\n"
            "from megalaunch.cli.main import main\n"
            f"main({argv!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 6, proc.stderr


@pytest.mark.parametrize("direction,error", [("hf-to-mcore", "is not a directory"), ("mcore-to-hf", "does not exist"),
                                             ("unfinished", "has no .metadata: the save did not finish")])
def test_a_missing_conversion_input_is_refused_before_torch(tmp_path, direction: str, error: str) -> None:
    """A typo in the path, or a checkpoint whose save did not finish, costs a login node a fraction of a
    second, not the ~15 s of importing torch and Megatron (and on the core install, where they are absent,
    the same one-line error)."""
    source = tmp_path / "missing"
    if direction == "unfinished":  # the tracker names iteration 1, whose save wrote metadata.json only
        direction, source = "mcore-to-hf", tmp_path / "checkpoints"
        (source / "iter_0000001").mkdir(parents=True)
        (source / "iter_0000001" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        (source / "latest_checkpointed_iteration.txt").write_text("1")
    code = ("import sys\nfrom megalaunch.cli.main import main\n"
            f"try:\n    code = main(['convert', {direction!r}, {str(source)!r}, '--out', {str(tmp_path / 'out')!r}])\n"
            "except SystemExit as e:\n    code = e.code\n"
            f"print(code, ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2"], (proc.stdout, proc.stderr)  # exit status 2, nothing heavy imported
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megalaunch: error:") and error in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
