"""`megalaunch report RUN`: one self-contained HTML page about a chain (docs/goodput.md).

`OUT/report.html` plus its figures as PNG files next to it (referenced relatively, no script, no
external URL), so the directory can be copied or attached as it is. The data come from the run
directory only (the ledger, the timelines, the metrics, the trigger audit, the checkpoints), so the
report works while the chain runs, for local and Slurm runs, and for any member of the run's group.

Four rooms, one concern each: `report_data` reads the run directory (standard library), `report_format`
names and colours what the other two show, `report_figures` draws the PNG files (matplotlib, the
`report` extra, imported inside the functions that draw) and `report_html` writes the page. This module
decides where the report goes and writes it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from megalaunch.errors import RunDirError
from megalaunch.launcher.report.data import gather
from megalaunch.launcher.report.figures import write_figures
from megalaunch.launcher.report.page import render_html
from megalaunch.launcher.report.style import summary_line
from megalaunch.rundir.files import atomic_write_text
from megalaunch.rundir.paths import RunPaths


@dataclass
class Report:
    html: Path
    figures: list[Path]
    summary: str
    out_note: str | None  # set when the report could not go to RUN/report/


def default_out(paths: RunPaths) -> tuple[Path, str | None]:
    """RUN/report/, or ./<chain-name>-report/ when this user cannot write in the run directory."""
    target = paths.root / "report"
    probe = target if target.is_dir() else paths.root
    if os.access(probe, os.W_OK | os.X_OK):
        return target, None
    local = Path.cwd() / f"{paths.root.name}-report"
    return local, f"you cannot write in {paths.root}; the report goes to {local}"


def write_report(paths: RunPaths, out: Path | None = None, now: float | None = None) -> Report:
    """Gather, draw and write OUT/report.html with its figures; returns where and a one-line summary."""
    note = None
    if out is None:
        out, note = default_out(paths)
    data = gather(paths, now)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the report directory {out}: {e.strerror or e}",
                          field="--out", fix="pass --out DIR with a directory you can write") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunDirError(f"cannot write in {out}", field="--out", fix="pass --out DIR with a directory you can write")
    figures = write_figures(data, out)
    path = out / "report.html"
    atomic_write_text(path, render_html(data, figures))
    return Report(html=path, figures=list(figures.values()), summary=summary_line(data), out_note=note)
