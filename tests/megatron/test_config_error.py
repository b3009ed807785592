"""Configuration errors that only the job can see end the chain after one segment (`megalaunch
submit` on the local backend, the real trainer on the CPU): the outcome is `config_error`, the
reason is readable (the assertion's source line when it has no text; the missing library), and
`megalaunch status` shows it with the fix. Nothing is retried."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.support import forkserver

from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.failures import installed

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _submit(tmp_path: Path, extra: dict, tasks: int = 1) -> tuple[RunPaths, subprocess.CompletedProcess[str]]:
    recipe = {"include": ["tiny"], "name": "cfgerr", "run": {"root": str(tmp_path / "runs")},
              "cluster": {"tasks_per_node": tasks, "time": "00:05:00", "python": forkserver.python(),
                          "env": {"OMP_NUM_THREADS": "1"}},
              "chain": {"max_segments_without_progress": 3}, **extra}
    path = tmp_path / "cfgerr.yaml"
    path.write_text(yaml.safe_dump(recipe))
    p = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "submit", str(path)], capture_output=True,
                       text=True, timeout=600, stdin=subprocess.DEVNULL)
    (run,) = [d for d in (tmp_path / "runs").iterdir() if not d.name.startswith(".")]
    return RunPaths(run), p


def _status(paths: RunPaths) -> str:
    p = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "status", str(paths.root)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.skipif(installed("transformer_engine"), reason="transformer-engine is installed here")
def test_missing_kernel_ends_the_chain_after_one_segment(tmp_path: Path) -> None:
    paths, p = _submit(tmp_path, {"training": {"attention": "te"}})
    segments = Ledger(paths).segments()
    assert len(segments) == 1, p.stdout + p.stderr
    assert segments[0].ended["outcome"] == "config_error"
    stopped = Ledger(paths).stopped()
    assert "training.attention: te needs transformer-engine" in stopped["reason"]
    text = _status(paths)
    assert "CONFIG_ERROR" in text and "no retry can fix it" in text
    assert "fix: --set training.attention=sdpa" in text


def test_megatron_assertion_without_text_names_its_source_line_and_stops_two_ranks(tmp_path: Path) -> None:
    """`assert args.num_dataset_builder_threads > 0` in Megatron's argument validation: a value only
    Megatron checks, on 2 ranks."""
    paths, p = _submit(tmp_path, {"megatron_args": {"num_dataset_builder_threads": 0}}, tasks=2)
    segments = Ledger(paths).segments()
    assert len(segments) == 1, p.stdout + p.stderr
    ended = segments[0].ended
    assert ended["outcome"] == "config_error", ended
    assert "assert args.num_dataset_builder_threads > 0" in ended["reason"]
    assert "megatron/training/arguments.py:" in ended["reason"]
    text = _status(paths)
    assert "configuration error" in text
    assert "fix: check megatron_args.num_dataset_builder_threads (now 0) in the recipe" in text
    assert "guard" not in [e["event"] for e in Ledger(paths).events()]  # no retry was considered
