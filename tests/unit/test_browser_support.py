"""tests/support/browser.py against small pages: each failure a report page could have is seen.

Runs the OS Chromium through playwright; skipped where either is missing, failed instead under
MEGALAUNCH_REQUIRE_BROWSER=1 (CI)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
from tests.support import browser
from tests.support.browser import open_page


def png_bytes(width: int, height: int, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A valid 8-bit RGB PNG of one colour, from the stdlib alone."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + bytes(rgb) * width  # filter type 0 per scanline
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


def write_page(directory: Path, body: str, *, name: str = "report.html") -> Path:
    page = directory / name
    page.write_text(
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>t</title></head>\n'
        f"<body>\n{body}\n</body></html>\n"
    )
    return page


def test_png_page_loads_clean(tmp_path: Path) -> None:
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "loss.png").write_bytes(png_bytes(7, 5))
    bars = "".join(f'<div class="bar" data-seg="{i}">segment {i}</div>' for i in range(3))
    page = write_page(
        tmp_path,
        f'<img src="figures/loss.png" alt="loss"><div class="timeline">{bars}</div>'
        "<script>console.log('ready'); document.title = 'Run report';</script>",
    )
    with open_page(page) as view:
        view.assert_clean(allow_warnings=False)
        assert view.problems() == []
        assert [(i.loaded, i.natural_width, i.natural_height) for i in view.images] == [(True, 7, 5)]
        assert view.images[0].src.endswith("/figures/loss.png")
        assert view.count(".timeline .bar") == 3
        assert view.texts(".timeline .bar") == ["segment 0", "segment 1", "segment 2"]
        assert view.evaluate("document.title") == "Run report"
        assert [(c.type, c.text) for c in view.console] == [("log", "ready")]
        assert view.page.locator(".bar[data-seg='1']").inner_text() == "segment 1"


def test_missing_image_is_a_failed_request_and_not_loaded(tmp_path: Path) -> None:
    (tmp_path / "ok.png").write_bytes(png_bytes(2, 2))
    page = write_page(tmp_path, '<img src="ok.png"><img src="figures/missing.png">')
    with open_page(page) as view:
        assert [i.loaded for i in view.images] == [True, False]
        assert [i.src.rsplit("/", 1)[-1] for i in view.broken_images] == ["missing.png"]
        assert [r.url.rsplit("/", 1)[-1] for r in view.failed_requests] == ["missing.png"]
        assert "FILE_NOT_FOUND" in view.failed_requests[0].failure
        with pytest.raises(AssertionError, match=r"missing\.png"):
            view.assert_clean()


def test_corrupt_png_is_not_loaded_though_the_file_exists(tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_bytes(png_bytes(4, 4)[:30])  # truncated: header only
    page = write_page(tmp_path, '<img src="bad.png">')
    with open_page(page) as view:
        assert len(view.images) == 1
        assert view.images[0].complete and view.images[0].natural_width == 0
        assert not view.images[0].loaded
        with pytest.raises(AssertionError, match=r"image not loaded: .*bad\.png"):
            view.assert_clean()


def test_uncaught_exception_is_a_page_error(tmp_path: Path) -> None:
    page = write_page(tmp_path, "<script>null.segments.length;</script><p>after</p>")
    with open_page(page) as view:
        assert len(view.page_errors) == 1
        assert "TypeError" in view.page_errors[0]
        with pytest.raises(AssertionError, match="page error: TypeError"):
            view.assert_clean()


def test_unhandled_rejection_is_a_page_error(tmp_path: Path) -> None:
    page = write_page(tmp_path, "<script>Promise.reject(new Error('no timeline data'));</script>")
    with open_page(page) as view:
        assert any("no timeline data" in e for e in view.page_errors), view.page_errors
        with pytest.raises(AssertionError):
            view.assert_clean()


def test_console_error_and_warning(tmp_path: Path) -> None:
    page = write_page(
        tmp_path, "<script>console.error('figure loss failed'); console.warn('slow segment');</script>"
    )
    with open_page(page) as view:
        assert [c.text for c in view.console_errors] == ["figure loss failed"]
        assert [c.text for c in view.console_warnings] == ["slow segment"]
        assert view.console_errors[0].location.startswith(view.url)
        with pytest.raises(AssertionError, match=r"console\.error: figure loss failed"):
            view.assert_clean()


def test_warning_alone_passes_unless_warnings_are_refused(tmp_path: Path) -> None:
    page = write_page(tmp_path, "<script>console.warn('deprecated');</script>")
    with open_page(page) as view:
        view.assert_clean()
        with pytest.raises(AssertionError, match=r"console\.warning: deprecated"):
            view.assert_clean(allow_warnings=False)


def test_external_resource_is_recorded_and_blocked(tmp_path: Path) -> None:
    # Loopback, a closed port, and aborted before any connection: a report must be self-contained.
    page = write_page(tmp_path, '<img src="http://127.0.0.1:9/logo.png">')
    with open_page(page) as view:
        assert view.external_requests == ["http://127.0.0.1:9/logo.png"]
        assert not view.images[0].loaded
        with pytest.raises(AssertionError, match="not self-contained"):
            view.assert_clean()


def test_image_added_by_script_is_waited_for(tmp_path: Path) -> None:
    (tmp_path / "late.png").write_bytes(png_bytes(3, 9))
    page = write_page(
        tmp_path,
        "<script>window.addEventListener('load', () => {"
        " const i = new Image(); i.src = 'late.png'; document.body.appendChild(i); });</script>",
    )
    with open_page(page) as view:
        assert [(i.loaded, i.natural_width, i.natural_height) for i in view.images] == [(True, 3, 9)]


def test_missing_html_file_raises(tmp_path: Path) -> None:
    browser.require_browser()  # skip first where there is no browser at all
    with pytest.raises(FileNotFoundError), open_page(tmp_path / "nope.html"):
        pass


# -- availability: skip where the browser is missing, fail under MEGALAUNCH_REQUIRE_BROWSER=1 --------


def test_missing_chromium_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(browser.REQUIRE_ENV, raising=False)
    monkeypatch.setenv(browser.CHROMIUM_ENV, str(tmp_path / "no-such-chromium"))
    pytest.importorskip("playwright.sync_api")
    with pytest.raises(pytest.skip.Exception, match="no Chromium binary"):
        browser.require_browser()


def test_missing_chromium_fails_when_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(browser.REQUIRE_ENV, "1")
    monkeypatch.setenv(browser.CHROMIUM_ENV, str(tmp_path / "no-such-chromium"))
    with pytest.raises(pytest.fail.Exception, match="MEGALAUNCH_REQUIRE_BROWSER=1 but"):
        browser.require_browser()


def test_missing_playwright_fails_when_required(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setenv(browser.REQUIRE_ENV, "1")
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)  # import raises ImportError
    with pytest.raises(pytest.fail.Exception, match="playwright is not installed"):
        browser.require_browser()
    monkeypatch.delenv(browser.REQUIRE_ENV)
    with pytest.raises(pytest.skip.Exception, match="playwright is not installed"):
        browser.require_browser()


def test_png_helper_is_valid() -> None:
    data = png_bytes(7, 5)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (7, 5)
