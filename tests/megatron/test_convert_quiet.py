"""`megalaunch convert` prints its result, not Megatron's import-time notices (no Transformer Engine,
Apex or absl, no CUDA runtime); `--debug` shows them; warnings after the import still show (issue 15)."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from tests.support.hf_models import make_hf_model
from tests.unit.helpers import cli

pytestmark = [pytest.mark.megatron,  # find_spec: importing transformers in every worker's collection costs ~1 CPU-s
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")]

NOISE = ("Transformer Engine and Apex are not installed", "absl.logging is not installed", "No CUDA runtime is found",
         "torch.distributed is disabled")


def _import_noise() -> list[str]:
    """What a bare `import megatron.core` prints here (none of it on a machine with TE, apex, absl, CUDA)."""
    proc = subprocess.run([sys.executable, "-c", "import megatron.core.dist_checkpointing"], capture_output=True,
                          text=True, check=True)
    return [n for n in NOISE if n in proc.stderr]


def test_convert_prints_no_import_noise_and_debug_shows_it(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    make_hf_model(hf, "llama")
    quiet = cli("convert", "hf-to-mcore", str(hf), "--out", str(tmp_path / "mc"), "--no-progress")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "" and "hf-to-mcore: 15 tensors" in quiet.stdout
    assert f"next: megalaunch submit RECIPE --set checkpoint.load={tmp_path / 'mc'}\n" in quiet.stdout
    back = cli("convert", "mcore-to-hf", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"), "--family", "llama",
               "--no-progress")
    assert back.returncode == 0, back.stderr
    assert back.stderr == "" and f"next: AutoModelForCausalLM.from_pretrained('{tmp_path / 'hf2'}')" in back.stdout
    noise = _import_noise()
    if not noise:
        pytest.skip("importing megatron prints nothing on this machine: nothing for --debug to show")
    loud = cli("--debug", "convert", "mcore-to-hf", str(tmp_path / "mc"), "--out", str(tmp_path / "hf3"),
               "--family", "llama", "--no-progress")
    assert loud.returncode == 0, loud.stderr
    assert all(n in loud.stderr for n in noise), loud.stderr


def test_quiet_import_restores_filters_and_loggers() -> None:
    from megalaunch.conversion.quiet_imports import NOISY_LOGGERS, import_megatron_quietly

    filters = list(warnings.filters)
    levels = [logging.getLogger(n).level for n in NOISY_LOGGERS]
    import_megatron_quietly()
    assert warnings.filters == filters and [logging.getLogger(n).level for n in NOISY_LOGGERS] == levels
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("a warning after the import", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning after the import"]


def test_convert_errors_still_show(tmp_path: Path) -> None:
    res = cli("convert", "mcore-to-hf", str(tmp_path / "missing"), "--out", str(tmp_path / "hf"))
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megalaunch: error:"), res.stderr
