"""`megalaunch report RUN` on a real local chain of the counter workload (tests/unit/report_chain.py):
the files, one timeline bar per segment, components that add up to each segment's wall time, the
trigger audit (escaped), the Young/Daly hint, a run still in progress, the fallback output directory
and the one-line error without matplotlib."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from tests.unit.helpers import cli
from tests.unit.report_chain import CRASH_AT, REPORT_CHAIN_GROUP, TRIGGER_REASON

from megalaunch.launcher.accounting.goodput import COMPONENTS
from megalaunch.launcher.report import write as report_mod
from megalaunch.launcher.report.data import gather
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

FIGURES = ("loss.png", "throughput.png", "timeline.png", "goodput.png")


pytestmark = REPORT_CHAIN_GROUP


@pytest.fixture
def run(report_chain: RunPaths) -> RunPaths:
    return report_chain


class Page(HTMLParser):
    """The elements the tests look at: timeline bars, goodput rows and their cells, trigger rows."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.bars: list[dict[str, str | None]] = []
        self.goodput: list[dict[str, object]] = []
        self.triggers: list[list[str]] = []
        self.imgs: list[str] = []
        self._gp = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if "timeline-bar" in classes:
            self.bars.append(a)
        if tag == "img":
            self.imgs.append(a.get("src") or "")
        if tag == "tr":
            self._gp: dict[str, float] | None = None
        if tag == "tr" and "goodput-row" in classes:
            self._gp = {}
            self.goodput.append({"job": a["data-job"], "wall": float(a["data-wall"] or 0), "parts": self._gp})
        if tag == "td" and a.get("data-component") and self._gp is not None:
            self._gp[a["data-component"] or ""] = float(a["data-seconds"] or 0)
        if tag == "tr" and "trigger-row" in classes:
            self._row = []
        if tag == "td" and self._row is not None:
            self._cell = []

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        if tag == "tr" and self._row is not None:
            self.triggers.append(self._row)
            self._row = None


def parse(html_path: Path) -> Page:
    page = Page()
    page.feed(html_path.read_text())
    return page


def assert_png(path: Path) -> None:
    """A complete PNG: signature, an IHDR with a non-zero size, chunks whose CRCs match, IEND last."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, (path, kind)
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks, (path, chunks)
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100, (path, width, height)


def test_report_of_a_chain(run: RunPaths, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = cli("report", str(run.root), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == str(out / "report.html") and lines[1].startswith("goodput "), proc.stdout
    segments = Ledger(run).segments()
    assert f"{len(segments)} segments" in lines[1]
    assert sorted(p.name for p in out.iterdir()) == sorted(["report.html", *FIGURES])
    for name in FIGURES:
        assert_png(out / name)
    page = parse(out / "report.html")
    assert sorted(page.imgs) == sorted(FIGURES)  # relative: the directory is self-contained
    # failed, saved (one segment, more where a loaded machine stepped slower than the timer allowed), finished
    expected = ["failed", *["saved"] * (len(segments) - 2), "finished"]
    assert [s.outcome for s in segments] == expected and len(segments) >= 3
    assert len(page.bars) == len(segments)
    assert [b["data-job"] for b in page.bars] == [s.job_id for s in segments]
    outcomes = [next(c for c in (b["class"] or "").split() if c.startswith("outcome-")) for b in page.bars]
    assert outcomes == [f"outcome-{o}" for o in expected]
    # each segment's components add up to its wall time, which is job begin -> job end in the ledger
    assert [g["job"] for g in page.goodput] == [s.job_id for s in segments]
    for row, seg in zip(page.goodput, segments, strict=True):
        parts = row["parts"]
        assert set(parts) == set(COMPONENTS)  # type: ignore[arg-type]
        assert abs(sum(parts.values()) - row["wall"]) < 1.0, row  # type: ignore[union-attr]
        assert seg.started and seg.ended
        assert abs(row["wall"] - (seg.ended["time"] - seg.started["time"])) < 1.0, row  # type: ignore[operator]
        assert parts["productive"] > 0 and parts["checkpoint_save"] > 0, row  # type: ignore[index]
    first = page.goodput[0]["parts"]
    assert first["lost_work"] > 0 and first["failed"] > 0  # type: ignore[index]  # crashed 10 steps after a save
    # the trigger audit: the save written before the chain started, acted on at iteration 0, escaped
    html_text = (out / "report.html").read_text()
    assert TRIGGER_REASON not in html_text and "eval &lt;b&gt;checkpoint&lt;/b&gt; &amp; more" in html_text
    (trig,) = page.triggers
    assert trig[0] == "save" and trig[2] == TRIGGER_REASON and trig[4].startswith("iteration 0 (job local-1")
    # Young/Daly: one failure observed, so a suggestion with its inputs
    data = gather(run)
    hint = data["hint"]
    assert hint["failures"] == 1 and hint["mtbf_s"] and hint["interval_s"] and hint["interval_iters"]
    assert f"= about <b>{hint['interval_iters']}</b> iterations" in html_text
    assert "in progress" not in html_text
    # checkpoints: every save with its time; the lost iterations after 40 were never saved
    its = [r["iteration"] for r in data["checkpoints"]]
    assert its[:3] == [0, 20, 40] and CRASH_AT not in its
    assert all(r["save_s"] is not None and r["save_s"] >= 0.15 for r in data["checkpoints"])  # COUNTER_SAVE_S


def test_report_while_a_segment_runs(run: RunPaths, tmp_path: Path) -> None:
    """The same chain cut where its last segment was running: that bar says `in progress`."""
    copy = tmp_path / run.root.name
    shutil.copytree(run.root, copy)
    paths = RunPaths(copy)
    events = [json.loads(line) for line in paths.ledger.read_text().splitlines()]
    last = [e for e in events if e["event"] == "ended"][-1]
    kept = [e for e in events if e["time"] < last["time"] - 0.5 and e["event"] != "chain_stopped"]
    paths.ledger.write_text("".join(json.dumps(e) + "\n" for e in kept))
    result = report_mod.write_report(paths, tmp_path / "out", now=last["time"] - 0.5)
    page = parse(result.html)
    assert len(page.bars) == len(Ledger(run).segments()) and "outcome-running" in (page.bars[-1]["class"] or "")
    html_text = result.html.read_text()
    assert "in progress" in html_text and "(in progress)" in result.summary
    row = page.goodput[-1]
    assert abs(sum(row["parts"].values()) - row["wall"]) < 1.0  # type: ignore[union-attr]


def test_default_output_directory(run: RunPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert report_mod.default_out(run) == (run.root / "report", None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(report_mod.os, "access", lambda *a, **k: False)  # a teammate's run: read only
    out, note = report_mod.default_out(run)
    assert out == tmp_path / f"{run.root.name}-report" and note and str(out) in note


def test_without_matplotlib_one_line(run: RunPaths) -> None:
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from megalaunch.cli.main import main\n"
            f"main(['report', {str(run.root)!r}])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "matplotlib" in line and "pip install 'megalaunch[report]'" in line


def test_not_a_run(tmp_path: Path) -> None:
    proc = cli("report", str(tmp_path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "not a run directory" in proc.stderr
