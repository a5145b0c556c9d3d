"""The page with API keys on (ATTEND_API_KEYS): it loads without a key, asks for one, keeps it in the tab's
sessionStorage only (never the URL, localStorage or a cookie), sends it as a Bearer header, and asks again
when the service answers 401."""

from __future__ import annotations

import pytest

from tests.server import running_service
from tests.web.conftest import open_tab

pytestmark = pytest.mark.slow

KEY = "page-key-7f3a9c"


@pytest.fixture(scope="module")
def service(repository):
    with running_service(repository, ATTEND_API_KEYS=f"another-key,{KEY}") as (url, _):
        yield url


@pytest.fixture
def tab(browser, service):
    tab = open_tab(browser, service)  # GET / answered 200 without a key
    yield tab
    tab.check()
    assert all(KEY not in url for url in tab.requests), "the key went into a URL"
    tab.page.close()


def give_key(page, key: str) -> None:
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key", key)
    page.click('#key-form button[type="submit"]')


def test_the_page_asks_for_the_key_and_keeps_it_for_the_tab_only(tab, browser, service):
    page = tab.page
    # GET /models answered 401: the page asks, saying nothing of a key it was never given.
    page.wait_for_selector("#key-dialog[open]")
    assert page.locator('#key-dialog .field-error[data-error-for="Authorization"]').is_hidden()
    give_key(page, "not-the-key")
    page.wait_for_selector("#key-dialog[open]")
    assert page.inner_text('#key-dialog .field-error[data-error-for="Authorization"]') == "the API key is not valid"
    give_key(page, KEY)
    page.wait_for_selector('body[data-state="shown"]')  # the book's example, drawn once the key was given
    assert page.locator("#model option").count() >= 4

    with page.expect_request(lambda r: r.url.endswith("/attend")) as sent:
        page.click("#send")
    page.wait_for_selector('body[data-state="shown"]')
    assert sent.value.headers["authorization"] == f"Bearer {KEY}"

    assert page.evaluate("() => sessionStorage.getItem('attend.apiKey')") == KEY
    assert page.evaluate("() => localStorage.length") == 0 and page.evaluate("() => document.cookie") == ""
    assert KEY not in page.url
    # Another tab has its own sessionStorage: it asks again.
    other = open_tab(browser, service)
    other.page.wait_for_selector("#key-dialog[open]")
    assert other.page.evaluate("() => sessionStorage.getItem('attend.apiKey')") is None
    other.check()
    other.page.close()


def test_a_401_while_sending_asks_again_and_then_sends(tab):
    """A key that stops working (revoked, mistyped in another tab) is asked for again; the request then goes."""
    page = tab.page
    give_key(page, KEY)
    page.wait_for_selector('body[data-state="shown"]')
    page.evaluate("() => sessionStorage.setItem('attend.apiKey', 'revoked-key')")
    statuses = []
    page.on("response", lambda r: statuses.append(r.status) if r.url.endswith("/attend") else None)
    page.click("#send")
    give_key(page, KEY)
    page.wait_for_selector('body[data-state="shown"]')
    assert statuses == [401, 200]
    assert page.locator("#weights figure.heatmap").count() == 2
