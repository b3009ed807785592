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
