"""GET / and its files, over HTTP without a browser (tests/web drives the page in one)."""

import re

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from service.http.app import create_app
from service.http.routes.page import STATIC_DIR


@pytest.fixture(scope="module")
def keyed(settings):
    with TestClient(create_app(settings.model_copy(update={"api_keys": SecretStr("the-key")}))) as client:
        yield client


def page_files(client) -> list[str]:
    """Every file the page loads: what index.html names, and what each module imports, followed."""
    html = client.get("/").text
    found = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    for path in found:
        if path.endswith(".js"):
            text = client.get(path).text
            found += [f"/static/js/{name}" for name in re.findall(r'from "\./([\w.]+)"', text)
                      if f"/static/js/{name}" not in found]
    return found


def test_the_page_and_its_files_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # The browser is told to load nothing from any other host.
    assert page.headers["content-security-policy"].startswith("default-src 'self';")
    files = page_files(client)
    assert {"/static/style.css", "/static/js/main.js", "/static/js/api.js", "/static/js/render.js"} <= set(files)
    for path in files:
        response = client.get(path)
        assert response.status_code == 200, path
        if path.endswith(".js"):  # ES modules load only with a JavaScript type
            assert "javascript" in response.headers["content-type"]


def test_the_page_names_no_other_host():
    """No CDN, no font service: the only absolute URL in the page's files is SVG's namespace (a name, never
    fetched)."""
    for path in STATIC_DIR.rglob("*"):
        if path.is_file():
            urls = set(re.findall(r"[a-z]+://[^\s\"'`)]+", path.read_text()))
            assert urls <= {"http://www.w3.org/2000/svg"}, path


def test_the_page_needs_no_key_but_the_api_still_does(keyed):
    assert keyed.get("/").status_code == 200
    assert all(keyed.get(path).status_code == 200 for path in page_files(keyed))
    assert keyed.get("/models").status_code == 401


def test_the_page_is_not_in_the_api_schema(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/static") for p in paths)
