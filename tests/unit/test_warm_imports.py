"""The start-up module list (runtime/observation/warm_imports.py): what a segment records, what a later one
imports during its health check, and that the import thread stops between two modules when told."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from megalaunch.runtime.observation.warm_imports import FILE_NAME, imported_since, record, recorded


def test_record_merges_in_order_and_keeps_only_torch_and_megatron_names(tmp_path: Path) -> None:
    assert recorded(tmp_path) == []  # no list: nothing to import
    assert record(tmp_path, ["torch.a", "megatron.core.b"])
    assert not record(tmp_path, ["megatron.core.b"])  # nothing new: the file is not rewritten
    assert record(tmp_path, ["torch.c", "torch.a"])
    assert recorded(tmp_path) == ["torch.a", "megatron.core.b", "torch.c"]
    (tmp_path / FILE_NAME).write_text(json.dumps({"modules": [
        "torch.ok", "os", "torchvision", "megatron_x", "torch.a; rm -rf /", "torch..x", 7, "megatron"]}))
    assert recorded(tmp_path) == ["torch.ok", "megatron"]


def test_unreadable_lists_are_no_list(tmp_path: Path) -> None:
    for text in ("", "{", "[1, 2]", '{"modules": "torch"}'):
        (tmp_path / FILE_NAME).write_text(text)
        assert recorded(tmp_path) == [], text


def test_imported_since_lists_new_package_modules_in_import_order() -> None:
    before = set(sys.modules)
    import email.mime.text  # noqa: F401 - a stdlib module: not a torch/megatron name

    assert "email.mime.text" not in imported_since(before)
    before.discard("megalaunch")
    assert imported_since(before) == []  # only torch.* and megatron.* are named


def _run(tmp_path: Path, body: str) -> dict:
    """Run `body` in a fresh interpreter where `megatron` is a small package made here."""
    pkg = tmp_path / "megatron"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "gate.py").write_text("import threading\nentered = threading.Event()\ngo = threading.Event()\n")
    (pkg / "first.py").write_text("from megatron.gate import entered, go\nentered.set()\nassert go.wait(30)\n")
    (pkg / "second.py").write_text("")
    (pkg / "broken.py").write_text("raise RuntimeError('no')\n")
    code = "import json, sys\nsys.path.insert(0, sys.argv[1])\n" + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_thread_imports_the_list_and_skips_what_fails(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        from megalaunch.runtime.observation.warm_imports import WarmImports
        import megatron.gate
        megatron.gate.go.set()
        warm = WarmImports(["megatron.broken", "megatron.first", "megatron.second", "megatron.gate"]).start()
        while warm.done < 3:
            warm._thread.join(0.01)
        figures = warm.stop()
        print(json.dumps({**figures, "second": "megatron.second" in sys.modules}))
    """)
    assert got["modules"] == 3 and got["imported"] == 2 and got["failed"] == 1 and got["second"], got


def test_stop_waits_for_the_module_under_way_and_imports_no_further(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        import threading
        from megalaunch.runtime.observation.warm_imports import WarmImports
        import megatron.gate
        warm = WarmImports(["megatron.first", "megatron.second"]).start()
        assert megatron.gate.entered.wait(30)  # the thread is inside megatron.first
        figures = {}
        stopper = threading.Thread(target=lambda: figures.update(warm.stop()))
        stopper.start()
        while not warm._stop.is_set():
            stopper.join(0.01)
        assert stopper.is_alive()  # stop() waits for the import under way
        megatron.gate.go.set()
        stopper.join(30)
        print(json.dumps({**figures, "second": "megatron.second" in sys.modules}))
    """)
    assert got["imported"] == 1 and not got["second"], got


def test_modules_already_imported_start_no_thread() -> None:
    from megalaunch.runtime.observation.warm_imports import WarmImports

    warm = WarmImports(["json", "sys"]).start()
    assert warm.names == [] and warm._thread.ident is None
    figures = warm.stop()
    assert (figures["modules"], figures["imported"], figures["failed"], figures["seconds"]) == (0, 0, 0, 0.0)
