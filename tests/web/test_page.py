"""GET /, the page, in headless chromium against the real service process: what it draws is what the
API answers for the same request, cell by cell."""

from __future__ import annotations

import itertools
import json

import httpx
import numpy as np
import pytest

from tests.server import running_service
from tests.web.conftest import SCREENSHOTS, open_tab

pytestmark = pytest.mark.slow

# What each heatmap holds, read from the DOM in one call: per figure its place and, per cell, the row,
# the column, the value as written (data-value), whether it is marked masked, and its fill.
_HEATMAPS = """(selector) => [...document.querySelectorAll(selector)].map((f) => ({
  batch: f.dataset.batch === undefined ? null : Number(f.dataset.batch),
  head: f.dataset.head === undefined ? null : Number(f.dataset.head),
  rows: Number(f.dataset.rows), cols: Number(f.dataset.cols), render: f.dataset.render,
  cells: [...f.querySelectorAll("rect.cell")].map((c) => [Number(c.dataset.row), Number(c.dataset.col),
    c.dataset.value, c.dataset.masked === "true", c.getAttribute("fill")]),
}))"""
_TABLES = """() => [...document.querySelectorAll("#outputs table.outputs")].map((t) =>
  [...t.querySelectorAll("td")].map((td) => [Number(td.dataset.row), Number(td.dataset.col), td.dataset.value]))"""
_ERRORS = """() => Object.fromEntries([...document.querySelectorAll("#request .field-error")]
  .filter((e) => !e.hidden).map((e) => [e.dataset.errorFor, e.textContent]))"""
HATCH = "url(#masked-hatch)"
DARKEST_RED = "rgb(103, 0, 13)"  # the top of the Reds scale


@pytest.fixture(scope="module")
def service(repository, tmp_path_factory):
    log = tmp_path_factory.mktemp("page") / "service.log"
    with running_service(repository, log_path=log, ATTEND_LOG_LEVEL="info") as (url, _):
        yield url, log


@pytest.fixture(scope="module")
def served(service, repository):
    """The models the service lists, by name: every one of the repository, each ready (the tests loop over
    them, which would check nothing over a list that came back short)."""
    models = {m["name"]: m for m in httpx.get(f"{service[0]}/models").json()["models"]}
    assert sorted(models) == sorted(p.name for p in repository.iterdir() if p.is_dir()), models
    assert {m["status"] for m in models.values()} == {"ready"}, models
    return models


@pytest.fixture
def tab(browser, service):
    """The page, once it has drawn the book's example of its first model (it does so on load, unasked)."""
    tab = open_tab(browser, service[0])
    tab.page.wait_for_selector('body[data-state="shown"]')
    yield tab
    tab.check()  # every test: no request to another host, no error in the console
    tab.page.close()


def send(tab) -> tuple[dict, int]:
    """Click Send; the body the page sent and the status it got, once the page has drawn the answer."""
    page = tab.page
    with page.expect_response(lambda r: r.url.endswith("/attend") and r.request.method == "POST") as answer:
        page.click("#send")
    page.wait_for_selector('body[data-state="shown"], body[data-state="error"]')
    return answer.value.request.post_data_json, answer.value.status


def api(service, body) -> httpx.Response:
    """The same request, straight to the API (no browser)."""
    return httpx.post(f"{service[0]}/attend", json=body, timeout=30)


def is_masked(valid_lens, b: int, q: int, k: int) -> bool:
    if valid_lens is None:
        return False
    length = valid_lens[b][q] if isinstance(valid_lens[b], list) else valid_lens[b]
    return k >= length


def luminance(fill: str) -> float:
    r, g, b = (int(x) for x in fill.removeprefix("rgb(").removesuffix(")").split(","))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def assert_heatmaps_show(tab, weights, valid_lens) -> None:
    """One heatmap per batch row (and head), each cell the API's weight; masked keys hatched, never coloured."""
    w = np.asarray(weights, dtype=np.float64)
    figures = tab.page.evaluate(_HEATMAPS, "#weights figure.heatmap")
    heads = range(w.shape[1]) if w.ndim == 4 else [None]
    assert [(f["batch"], f["head"]) for f in figures] == [(b, h) for b in range(w.shape[0]) for h in heads]
    shown = []
    for f in figures:
        matrix = w[f["batch"], f["head"]] if w.ndim == 4 else w[f["batch"]]
        assert (f["rows"], f["cols"]) == matrix.shape and f["render"] == "svg"
        assert len(f["cells"]) == matrix.size
        for q, k, value, masked, fill in f["cells"]:
            assert float(value) == matrix[q, k], (f["batch"], f["head"], q, k)  # the API's float, exactly
            assert masked == is_masked(valid_lens, f["batch"], q, k), (f["batch"], f["head"], q, k)
            if masked:
                assert float(value) == 0.0 and fill == HATCH
            else:
                assert fill.startswith("rgb(")
                shown.append((float(value), luminance(fill), fill))
    # The colour follows the value: a larger weight is never lighter; the largest is the scale's darkest.
    shown.sort()
    assert all(a[1] >= b[1] for a, b in itertools.pairwise(shown))
    assert shown[-1][2] == DARKEST_RED
    bar = tab.page.locator("#weights .colour-bar")
    assert float(bar.get_attribute("data-max")) == shown[-1][0]
    assert (tab.page.locator("#weights .masked-swatch").count() == 1) == (valid_lens is not None)


def assert_outputs_show(tab, outputs) -> None:
    tables = tab.page.evaluate(_TABLES)
    assert len(tables) == len(outputs)
    for b, cells in enumerate(tables):
        assert len(cells) == len(outputs[b]) * len(outputs[b][0])
        for q, j, value in cells:
            assert float(value) == outputs[b][q][j], (b, q, j)


BOOK_KINDS = ["additive", "dot_product", "multi_head", "self_attention", "masked_softmax"]
_FIELDS = """() => Object.fromEntries([...document.querySelectorAll("#fields textarea")]
  .filter((t) => t.value.trim()).map((t) => [t.name, JSON.parse(t.value)]))"""


def test_the_page_opens_on_the_books_example_drawn_without_a_click(browser, service, served):
    """The first model (additive, the chapter's first) with the book's example, its heatmaps and outputs drawn
    on load: one POST /attend, made by the page itself, and what it draws is what the API answers."""
    tab = open_tab(browser, service[0])
    page = tab.page
    page.wait_for_selector('body[data-state="shown"]')  # no click, no key: the page got there by itself
    first = [name for name, m in served.items() if m["status"] == "ready"][0]
    assert first == "additive" and page.input_value("#model") == first
    body = {"model": first} | page.evaluate(_FIELDS)
    assert body["valid_lens"] == [2, 6] and np.shape(body["queries"]) == (2, 1, 20)  # the book's example
    assert page.locator("#result").is_visible()
    expected = api(service, body).json()
    assert_heatmaps_show(tab, expected["attention_weights"], body["valid_lens"])
    assert_outputs_show(tab, expected["outputs"])
    np.testing.assert_allclose(expected["outputs"], [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-5)
    assert [url for url in tab.requests if url.endswith("/attend")] == [f"{service[0]}/attend"]
    tab.check()
    page.close()


@pytest.mark.parametrize("kind", BOOK_KINDS)
def test_the_books_example_of_each_kind_is_drawn_as_the_api_answers_it(tab, service, served, kind):
    assert kind in served
    page = tab.page
    page.select_option("#model", kind)
    page.click("#book")
    body, status = send(tab)
    assert status == 200 and body["model"] == kind
    answer = api(service, body)
    assert answer.status_code == 200
    expected = answer.json()
    assert_heatmaps_show(tab, expected["attention_weights"], body.get("valid_lens"))
    assert_outputs_show(tab, expected["outputs"])
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"{kind}.png", full_page=True)


def test_the_book_additive_example_shows_the_books_numbers(tab, service):
    """The chapter: identical keys, so uniform weights over the valid keys (2 and 6 of 10), and the outputs
    [[2, 3, 4, 5]] and [[10, 11, 12, 13]] whatever the queries."""
    page = tab.page
    page.select_option("#model", "additive")
    body, status = send(tab)
    assert status == 200 and body["valid_lens"] == [2, 6] and np.shape(body["queries"]) == (2, 1, 20)
    figures = page.evaluate(_HEATMAPS, "#weights figure.heatmap")
    weights = [[float(v) for _, _, v, _, _ in f["cells"]] for f in figures]
    np.testing.assert_allclose(weights, [[0.5] * 2 + [0] * 8, [1 / 6] * 6 + [0] * 4], rtol=1e-6)
    outputs = [[float(v) for *_, v in cells] for cells in page.evaluate(_TABLES)]
    np.testing.assert_allclose(outputs, [[2, 3, 4, 5], [10, 11, 12, 13]], rtol=1e-5)
    # The value under the pointer, and a masked key said to be masked.
    page.hover('#weights figure[data-batch="1"] rect[data-row="0"][data-col="3"]')
    assert page.inner_text("#weights .readout") == f"batch 1, query 0, key 3: {figures[1]['cells'][3][2]}"
    page.hover('#weights figure[data-batch="0"] rect[data-row="0"][data-col="7"]')
    assert page.inner_text("#weights .readout") == "batch 0, query 0, key 7: masked, weight 0"


def test_random_inputs_follow_the_controls_and_2d_valid_lengths_mask_per_query(tab, service):
    page = tab.page
    page.select_option("#model", "dot_product")
    for axis, size in {"batch": 2, "n_q": 3, "n_k": 5, "d": 4, "value_size": 3}.items():
        page.fill(f'input[name="axis-{axis}"]', str(size))
    page.check('input[name="lens"][value="2d"]')
    page.click("#random")
    generated = json.loads(page.input_value('textarea[name="valid_lens"]'))
    assert np.shape(generated) == (2, 3) and all(1 <= n <= 5 for row in generated for n in row)
    # A length of 0 attends to nothing: that row is all masked, weights exactly 0.
    page.fill('textarea[name="valid_lens"]', "[[0, 5, 2], [1, 3, 4]]")
    body, status = send(tab)
    assert status == 200
    assert [np.shape(body[f]) for f in ("queries", "keys", "values")] == [(2, 3, 4), (2, 5, 4), (2, 5, 3)]
    expected = api(service, body).json()
    assert_heatmaps_show(tab, expected["attention_weights"], body["valid_lens"])
    assert_outputs_show(tab, expected["outputs"])
    masked = page.locator('#weights figure[data-batch="0"] rect[data-row="0"][data-masked="true"]')
    assert masked.count() == 5


def test_a_large_heatmap_is_drawn_on_a_canvas_with_the_same_colours(tab, service):
    """Past 4096 cells a heatmap is a canvas: its pixels are the colour scale's (masked keys grey), and the
    readout gives the API's value of the cell under the pointer."""
    page = tab.page
    page.select_option("#model", "dot_product")
    for axis, size in {"batch": 1, "n_q": 70, "n_k": 70, "d": 2, "value_size": 2}.items():
        page.fill(f'input[name="axis-{axis}"]', str(size))
    page.check('input[name="lens"][value="1d"]')
    page.click("#random")
    page.fill('textarea[name="valid_lens"]', "[50]")
    body, status = send(tab)
    assert status == 200
    weights = np.asarray(api(service, body).json()["attention_weights"])[0]
    canvas = page.locator('#weights figure[data-render="canvas"] canvas')
    assert canvas.count() == 1
    # Pixels at the centres of a few cells, straight from the canvas.
    cells = [(0, 0), (10, 49), (69, 20), (5, 50), (30, 69)]
    pixels = canvas.evaluate("""(c, cells) => {
        const size = c.width / 70, context = c.getContext("2d");
        return cells.map(([i, j]) => [...context.getImageData((j + 0.5) * size, (i + 0.5) * size, 1, 1).data]);
    }""", cells)
    for (i, j), (r, g, b, _) in zip(cells, pixels, strict=True):
        if j >= 50:
            assert r == g == b, (i, j)  # the hatch's grey: never a colour of the scale
        else:
            assert r > b and r >= g and (r, g, b) != (255, 255, 255), (i, j)  # a red of the scale
    box = canvas.bounding_box()
    size = box["width"] / 70
    page.mouse.move(box["x"] + 20.5 * size, box["y"] + 10.5 * size)
    words, value = page.inner_text("#weights .readout").rsplit(": ", 1)
    assert words == "batch 0, query 10, key 20" and float(value) == weights[10, 20]


BAD = [
    # (model, field, what the field is made to hold)
    ("additive", "keys", json.dumps(np.ones((3, 10, 2)).tolist())),  # a batch of 3 against queries of 2
    ("additive", "queries", json.dumps(np.ones((2, 1, 3)).tolist())),  # this model's query_size is 20
    ("dot_product", "valid_lens", "[11, 1]"),  # n_k is 10
    ("self_attention", "valid_lens", "[[1, 2]]"),  # neither (batch,) nor (batch, n)
    ("multi_head", "values", "[[[1, 2]]]"),  # value_size is 100
]


@pytest.mark.parametrize("model, field, text", BAD, ids=[f"{m}-{f}" for m, f, _ in BAD])
def test_a_bad_request_shows_the_services_error_next_to_its_field(tab, service, model, field, text):
    page = tab.page
    page.select_option("#model", model)
    page.click("#send")  # a good answer first: a bad one must not leave it on show
    page.wait_for_selector('body[data-state="shown"]')
    page.fill(f'textarea[name="{field}"]', text)
    body, status = send(tab)
    error = api(service, body).json()["error"]
    assert status == 422 and error["field"] == field
    shown = page.evaluate(_ERRORS)
    assert list(shown) == [field]  # next to that field, and nowhere else
    assert shown[field].startswith(error["message"])
    if "expected" in error:
        assert f"expected {json.dumps(error['expected'], separators=(',', ':'))}" in shown[field]
    assert page.get_attribute(f'textarea[name="{field}"]', "aria-invalid") == "true"
    assert page.locator("#result").is_hidden()
    # Fixed and sent again: the error goes.
    page.click("#book")
    assert send(tab)[1] == 200 and page.evaluate(_ERRORS) == {}


def test_text_that_is_not_json_is_named_without_a_request(tab):
    page = tab.page
    page.select_option("#model", "additive")
    page.fill('textarea[name="keys"]', "[[1, 2")
    before = len(tab.requests)
    page.click("#send")
    page.wait_for_selector('body[data-state="error"]')
    shown = page.evaluate(_ERRORS)
    assert list(shown) == ["keys"] and shown["keys"].startswith("keys is not JSON")
    assert tab.requests[before:] == []


def test_the_positional_encoding_view_draws_p_and_its_columns(tab, service, served):
    """The chapter's figures: P for 60 positions and 32 dimensions as a heatmap, columns 6 to 9 as curves."""
    assert "positional_encoding" in served
    page = tab.page
    page.select_option("#model", "positional_encoding")
    page.click("#book")
    body, status = send(tab)
    size = served["positional_encoding"]["inputs"][0]["shape"][-1]
    d = size if isinstance(size, int) else 32  # the book's 32, where the model leaves d free
    assert status == 200 and np.shape(body["queries"]) == (1, 60, d)
    expected = api(service, body).json()
    P = np.asarray(expected["P"], dtype=np.float64)
    assert P.shape == (60, d)
    [figure] = page.evaluate(_HEATMAPS, "#pe-heatmap")
    assert (figure["rows"], figure["cols"]) == (60, d) and len(figure["cells"]) == 60 * d
    for i, j, value, masked, _ in figure["cells"]:
        assert float(value) == P[i, j] and not masked
    lines = page.evaluate("""() => [...document.querySelectorAll("#pe-curves polyline")]
        .map((l) => [Number(l.dataset.column), JSON.parse(l.dataset.values)])""")
    assert [c for c, _ in lines] == [6, 7, 8, 9]
    for c, values in lines:
        assert values == P[:, c].tolist()
    assert_outputs_show(tab, expected["outputs"])
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "positional_encoding.png", full_page=True)
    page.locator("#pe").screenshot(path=SCREENSHOTS / "positional_encoding-P.png")  # the chapter's two figures
    # Other columns on request; a column past the last is named next to the box.
    page.fill("#pe-columns", f"0-1, {d - 1}")
    assert page.evaluate('() => [...document.querySelectorAll("#pe-curves polyline")].map((l) => l.dataset.column)') \
        == ["0", "1", str(d - 1)]
    page.fill("#pe-columns", str(d))
    assert page.inner_text('#pe .field-error[data-error-for="columns"]') == f"column {d} is past the last one, {d - 1}"


def test_every_model_of_the_service_is_offered_with_its_inputs(tab, served):
    """The model list is GET /models', and each model's fields are its inputs there (none hard-coded)."""
    page = tab.page
    ready = [name for name, m in served.items() if m["status"] == "ready"]
    assert page.evaluate('() => [...document.querySelectorAll("#model option")].map((o) => o.value)') == ready
    for name in ready:
        page.select_option("#model", name)
        fields = page.evaluate('() => [...document.querySelectorAll("#fields textarea")].map((t) => t.name)')
        inputs = [spec["name"] for spec in served[name]["inputs"]]
        assert sorted(fields) == sorted(inputs)
        axes = {a for spec in served[name]["inputs"] for a in spec["shape"] if isinstance(a, str)}
        assert {box.get_attribute("data-axis") for box in page.locator("#axes input").all()} == axes


def test_the_page_asks_nothing_of_any_other_host(tab, served):
    """Every model's example sent and drawn, and the page's requests all went to the service itself."""
    page = tab.page
    for name, model in served.items():
        if model["status"] == "ready":
            page.select_option("#model", name)
            page.click("#book")
            assert send(tab)[1] == 200
    assert tab.requests and tab.foreign_requests() == []
    assert {"/", "/static/style.css", "/static/js/main.js", "/models", "/attend"} <= \
        {"/" + url.split("/", 3)[3] for url in tab.requests}


def test_the_start_up_line_names_the_page(service):
    url, log = service
    assert f"serving on {url}/ (the page; API docs: {url}/docs)" in log.read_text()
