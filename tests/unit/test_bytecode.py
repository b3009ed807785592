"""The trainer's bytecode cache where PYTHONDONTWRITEBYTECODE turned Python's off (runtime/bytecode.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
from pathlib import Path
from megalaunch.runtime.bytecode import enable_cache
print(enable_cache(Path(sys.argv[1]), probe=sys.argv[3]))
sys.path.insert(0, sys.argv[2])
import probe_module  # noqa
"""


def _run(tmp_path: Path, probe: str = "probe_module", **env: str) -> str:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "probe_module.py").write_text("X = 1\n")
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "cache"), str(src), probe],
                          env={**full, **env, "PYTHONPATH": f"{src}{os.pathsep}{full.get('PYTHONPATH', '')}"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_bytecode_goes_to_the_cache_when_the_environment_turned_it_off(tmp_path: Path) -> None:
    said = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert said.startswith("PYTHONDONTWRITEBYTECODE is set: bytecode cached under")
    assert list((tmp_path / "cache").rglob("probe_module.cpython-*.pyc"))  # written under the prefix ...
    assert not (tmp_path / "src" / "__pycache__").exists()  # ... never next to the sources


def test_python_left_alone_when_it_writes_bytecode_or_when_asked(tmp_path: Path) -> None:
    assert _run(tmp_path) == "None"
    assert _run(tmp_path, PYTHONDONTWRITEBYTECODE="1", MEGALAUNCH_BYTECODE_CACHE="0") == "None"
    assert not (tmp_path / "cache").exists()


def test_a_cache_directory_others_can_write_is_never_used(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache").chmod(0o770)  # group-writable: a member could plant bytecode there
    said = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert said.startswith("bytecode cache not enabled:") and not list((tmp_path / "cache").rglob("*.pyc"))


def test_packages_installed_with_bytecode_keep_it(tmp_path: Path) -> None:
    """pip compiles what it installs: a prefix would only make Python compile it all again."""
    import py_compile

    _run(tmp_path, MEGALAUNCH_BYTECODE_CACHE="0")  # writes the probe module
    py_compile.compile(str(tmp_path / "src" / "probe_module.py"))  # its bytecode beside it, as pip leaves it
    assert _run(tmp_path, PYTHONDONTWRITEBYTECODE="1") == "None"
    assert not (tmp_path / "cache").exists()
