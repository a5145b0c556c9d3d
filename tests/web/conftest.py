"""The page in a real headless browser: Debian's chromium, driven by Playwright.

Playwright's own browser download cannot be reached here, so it is pointed at the system's chromium
(`make test` installs it: `apt-get install chromium`). Without that browser these tests FAIL, saying how to
get it; they skip only when asked to, with ATTEND_SKIP_BROWSER=1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import BrowserContext, Page, Playwright, sync_playwright

from tests.server import ROOT

CHROMIUM = os.environ.get("ATTEND_CHROMIUM", "/usr/bin/chromium")
# No GPU, no sandbox (root in a container), and none of chromium's own traffic (updates, sync, QUIC probes),
# so that every request the tests see is the page's.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Screenshots, one per kind: test artefacts (docs/ holds the ones the README shows).
SCREENSHOTS = Path(os.environ.get("ATTEND_SCREENSHOTS", ROOT / "build" / "screenshots"))
# Chromium logs every 4xx/5xx answer to fetch() as a console error; the page shows those itself.
_HTTP_STATUS_LINE = "Failed to load resource: the server responded with a status of"


@pytest.fixture(scope="session")
def chromium() -> str:
    if os.environ.get("ATTEND_SKIP_BROWSER") == "1":
        pytest.skip("ATTEND_SKIP_BROWSER=1: the browser tests of the page are skipped")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no browser at {CHROMIUM}: `apt-get install -y chromium` (make test does), point "
                    "ATTEND_CHROMIUM at one, or set ATTEND_SKIP_BROWSER=1 to skip the page's tests", pytrace=False)
    return CHROMIUM


@pytest.fixture(scope="module")
def playwright(chromium) -> Iterator[Playwright]:
    # Per module, not per session: the sync API keeps an event loop of its own while it runs.
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright, chromium, tmp_path_factory) -> Iterator[BrowserContext]:
    """A browser with a fresh profile (user-data dir) of its own."""
    context = playwright.chromium.launch_persistent_context(
        tmp_path_factory.mktemp("chromium-profile"), executable_path=chromium, headless=True, args=ARGS,
        viewport={"width": 1200, "height": 900})
    context.set_default_timeout(15_000)
    yield context
    context.close()


class Tab:
    """A tab of the page, with every URL it asked for and every error it logged."""

    def __init__(self, page: Page, origin: str):
        self.page = page
        self.origin = origin
        self.requests: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda request: self.requests.append(request.url))
        page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))
        page.on("console", lambda m: self.errors.append(m.text)
                if m.type == "error" and not m.text.startswith(_HTTP_STATUS_LINE) else None)

    def foreign_requests(self) -> list[str]:
        """Requests to anywhere but the service (data: URLs go nowhere)."""
        return [url for url in self.requests
                if not url.startswith("data:") and f"{urlsplit(url).scheme}://{urlsplit(url).netloc}" != self.origin]

    def check(self) -> None:
        assert self.foreign_requests() == [], "the page asked another host"
        assert self.errors == [], "the page logged errors"


def open_tab(browser: BrowserContext, url: str) -> Tab:
    tab = Tab(browser.new_page(), url)
    response = tab.page.goto(f"{url}/")
    assert response is not None and response.status == 200
    return tab
