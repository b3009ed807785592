"""Open a local HTML page in the system's headless Chromium and report what went wrong in it.

For tests of pages that megalaunch writes (``megalaunch report RUN`` → ``report.html``)::

    from tests.support.browser import open_page

    def test_report_in_browser(tmp_path):
        ...  # write out/report.html
        with open_page(out / "report.html") as view:
            view.assert_clean()                      # no console error, page error, failed request
            assert view.images and all(i.loaded for i in view.images)
            assert view.count(".timeline .bar") == n_segments
            assert view.evaluate("document.title") == "..."
            view.page.click("text=Segment 2")        # the playwright Page, for anything else

The browser is the OS package (Debian/Ubuntu ``apt-get install chromium``) driven by
playwright-python (``pip install playwright``, the ``dev`` extra); ``playwright install`` is never
needed: the browser is launched from its path. Where playwright or the browser is missing, the test
is skipped with the reason, unless ``MEGALAUNCH_REQUIRE_BROWSER=1`` (CI: ``scripts/test`` as root,
after installing both), where it fails instead. ``MEGALAUNCH_CHROMIUM`` names another binary.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Page

REQUIRE_ENV = "MEGALAUNCH_REQUIRE_BROWSER"
CHROMIUM_ENV = "MEGALAUNCH_CHROMIUM"
# Debian: /usr/bin/chromium (a shell wrapper around /usr/lib/chromium/chromium); others, in order.
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
# Playwright itself adds --headless, --no-sandbox (root in a container has no usable sandbox) and
# --disable-dev-shm-usage (small /dev/shm in containers); these are the rest that a headless
# software-rendered run needs. chromium_sandbox=False is passed explicitly as well.
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")
DEFAULT_TIMEOUT_S = 30.0


def browser_required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def _unavailable(reason: str) -> None:
    if browser_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def find_chromium() -> str | None:
    """The system Chromium's path: $MEGALAUNCH_CHROMIUM, else the first of CHROMIUM_NAMES on PATH."""
    override = os.environ.get(CHROMIUM_ENV)
    if override:
        return shutil.which(override)
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def require_browser() -> str:
    """The Chromium path, after checking that playwright imports; skips (or fails, see module doc)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        _unavailable(f"playwright is not installed ({exc}): pip install -e '.[dev]'")
    exe = find_chromium()
    if exe is None:
        where = os.environ.get(CHROMIUM_ENV) or " / ".join(CHROMIUM_NAMES)
        _unavailable(f"no Chromium binary found ({where}): apt-get install chromium")
    assert exe is not None
    return exe


@dataclass(frozen=True)
class ConsoleEntry:
    type: str  # "error", "warning", "log", "info", "debug", ...
    text: str
    location: str  # url:line:column


@dataclass(frozen=True)
class FailedRequest:
    url: str
    failure: str  # e.g. "net::ERR_FILE_NOT_FOUND"


@dataclass(frozen=True)
class ImageState:
    src: str  # resolved URL (img.currentSrc or img.src)
    complete: bool
    natural_width: int
    natural_height: int

    @property
    def loaded(self) -> bool:
        """Fetched and decoded: complete with a nonzero natural size (a broken image is complete, 0 wide)."""
        return self.complete and self.natural_width > 0 and self.natural_height > 0


@dataclass
class PageReport:
    """What the browser saw on one page. Lists fill while the page stays open (the `with` block)."""

    url: str
    page: Page
    console: list[ConsoleEntry] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)  # uncaught exceptions / unhandled rejections
    failed_requests: list[FailedRequest] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)  # anything not file:/data:/blob:/about:
    http_errors: list[str] = field(default_factory=list)  # responses with status >= 400
    images: list[ImageState] = field(default_factory=list)  # every <img>, read after load

    @property
    def console_errors(self) -> list[ConsoleEntry]:
        return [c for c in self.console if c.type == "error"]

    @property
    def console_warnings(self) -> list[ConsoleEntry]:
        return [c for c in self.console if c.type == "warning"]

    @property
    def broken_images(self) -> list[ImageState]:
        return [i for i in self.images if not i.loaded]

    def refresh_images(self) -> list[ImageState]:
        """Re-read every <img> (after the page's scripts added or changed some)."""
        raw = self.page.evaluate(_IMAGES_JS)
        self.images = [
            ImageState(
                src=str(r["src"]),
                complete=bool(r["complete"]),
                natural_width=int(r["w"]),
                natural_height=int(r["h"]),
            )
            for r in raw
        ]
        return self.images

    def evaluate(self, expression: str, arg: Any = None) -> Any:
        """Run a JS expression or function in the page; returns its (JSON-able) value."""
        return self.page.evaluate(expression, arg)

    def count(self, selector: str) -> int:
        """How many elements match a CSS selector."""
        return int(self.page.evaluate("s => document.querySelectorAll(s).length", selector))

    def texts(self, selector: str) -> list[str]:
        """The trimmed textContent of every element matching a CSS selector."""
        return list(
            self.page.evaluate(
                "s => Array.from(document.querySelectorAll(s), e => (e.textContent || '').trim())", selector
            )
        )

    def problems(self, *, allow_warnings: bool = True) -> list[str]:
        """Everything that should not happen on a self-contained page, one line each."""
        out = [f"console.{c.type}: {c.text} ({c.location})" for c in self.console_errors]
        if not allow_warnings:
            out += [f"console.{c.type}: {c.text} ({c.location})" for c in self.console_warnings]
        out += [f"page error: {e}" for e in self.page_errors]
        out += [f"failed request: {r.url} ({r.failure})" for r in self.failed_requests]
        out += [f"HTTP error: {h}" for h in self.http_errors]
        out += [f"external request (page is not self-contained): {u}" for u in self.external_requests]
        out += [
            f"image not loaded: {i.src} (complete={i.complete}, {i.natural_width}x{i.natural_height})"
            for i in self.broken_images
        ]
        return out

    def assert_clean(self, *, allow_warnings: bool = True) -> None:
        problems = self.problems(allow_warnings=allow_warnings)
        assert not problems, f"{self.url}: {len(problems)} problem(s) in the browser:\n  " + "\n  ".join(
            problems
        )


_IMAGES_JS = """() => Array.from(document.images, i => ({
  src: i.currentSrc || i.src, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight}))"""

# True once every <img> has finished (loaded or failed): the load event already covers images in
# the HTML; this covers ones that the page's scripts inserted during load.
_IMAGES_SETTLED_JS = "() => Array.from(document.images).every(i => i.complete)"

_LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")


_playwright: list[Any] = []  # the playwright driver, started once per test process
_browsers: dict[str, Any] = {}  # an executable's path -> its Chromium


def _browser(exe: str, timeout_ms: float) -> Any:
    """One Chromium per test process, launched on first use and closed at exit: a launch (playwright's
    driver and the browser) costs ~3-4 CPU-s here, and the browser tests opened 11 pages. Each page
    gets a context of its own (fresh storage, cache, cookies, viewport), closed after it; a browser
    that went away is launched again."""
    browser = _browsers.get(exe)
    if browser is not None and browser.is_connected():
        return browser
    if not _playwright:
        from playwright.sync_api import sync_playwright

        _playwright.append(sync_playwright().start())
        atexit.register(_close_all)
    browser = _browsers[exe] = _playwright[0].chromium.launch(
        executable_path=exe, headless=True, chromium_sandbox=False, args=list(CHROMIUM_ARGS), timeout=timeout_ms)
    return browser


def _close_all() -> None:
    for browser in _browsers.values():
        with contextlib.suppress(Exception):
            browser.close()
    with contextlib.suppress(Exception):
        _playwright[0].stop()
    _browsers.clear()
    _playwright.clear()


@contextmanager
def open_page(
    html: str | os.PathLike[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    viewport: tuple[int, int] = (1280, 900),
    block_external: bool = True,
) -> Iterator[PageReport]:
    """Open a local HTML file in headless system Chromium; yield a PageReport once it has loaded.

    Waits for the load event and for every <img> to finish. External (non-file) requests are
    recorded and, with `block_external`, aborted: a report must be self-contained. Every browser
    step is bounded by `timeout_s`. Skips (or fails) when no browser is available.
    """
    exe = require_browser()
    path = Path(html).resolve()
    if not path.is_file():
        raise FileNotFoundError(path)
    url = path.as_uri()
    timeout_ms = timeout_s * 1000
    context = _browser(exe, timeout_ms).new_context(viewport={"width": viewport[0], "height": viewport[1]})
    try:
        context.set_default_timeout(timeout_ms)
        context.set_default_navigation_timeout(timeout_ms)
        page = context.new_page()
        report = PageReport(url=url, page=page)
        page.on(
            "console",
            lambda m: report.console.append(
                ConsoleEntry(type=m.type, text=m.text, location=_location(m.location))
            ),
        )
        page.on("pageerror", lambda e: report.page_errors.append(f"{e.name}: {e.message}".strip(": ")))
        page.on(
            "requestfailed",
            lambda r: report.failed_requests.append(FailedRequest(url=r.url, failure=r.failure or "?")),
        )
        page.on(
            "response",
            lambda r: report.http_errors.append(f"{r.status} {r.url}") if r.status >= 400 else None,
        )

        def route(r: Any) -> None:
            request_url = r.request.url
            if request_url.startswith(_LOCAL_SCHEMES):
                r.continue_()
                return
            report.external_requests.append(request_url)
            if block_external:
                r.abort("blockedbyclient")
            else:
                r.continue_()

        page.route("**/*", route)
        page.goto(url, wait_until="load", timeout=timeout_ms)
        page.wait_for_function(_IMAGES_SETTLED_JS, timeout=timeout_ms)
        report.refresh_images()
        yield report
    finally:
        context.close()


def _location(loc: Any) -> str:
    if not loc:
        return "?"
    return f"{loc.get('url', '?')}:{loc.get('lineNumber', '?')}:{loc.get('columnNumber', '?')}"
