"""The report in a real browser (issue #11 item 6): the system Chromium, driven by playwright, opens
report.html of a three-segment chain: no console error, no failed or external request, every figure
loads, and the timeline has one bar per segment. Skipped without Chromium unless
MEGALAUNCH_REQUIRE_BROWSER=1 (tests/support/browser.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.browser import open_page, require_browser
from tests.unit.helpers import cli
from tests.unit.report_chain import REPORT_CHAIN_GROUP

from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths


@REPORT_CHAIN_GROUP
def test_report_opens_clean_in_chromium(tmp_path: Path, report_chain: RunPaths) -> None:
    require_browser()
    shutil.copytree(report_chain.root, tmp_path / report_chain.root.name)  # the report is written into the run
    paths = RunPaths(tmp_path / report_chain.root.name)
    proc = cli("report", str(paths.root))
    assert proc.returncode == 0, proc.stderr
    html = paths.root / "report" / "report.html"
    assert proc.stdout.splitlines()[0] == str(html)
    segments = Ledger(paths).segments()
    assert len(segments) >= 3  # tests/unit/report_chain.py: 3, more when a loaded machine steps slower
    with open_page(html) as view:
        view.assert_clean()
        assert len(view.images) == 4 and not view.broken_images
        assert view.count(".timeline-bar") == len(segments)
        assert view.evaluate("document.title") == f"megalaunch report: {paths.root.name}"
        assert view.texts(".timeline-bar .seg-label") == [
            "failed: rank 0 on " + view.texts(".timeline-bar .seg-label")[0].split("rank 0 on ", 1)[1],
            *["saved: signal"] * (len(segments) - 2), "finished"]
