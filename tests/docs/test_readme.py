"""README.md: short, the two commands and the port on its first screen, and its examples run as written
against the real service (the curl call prints the answer the README shows; the tritonclient call prints the
book's numbers); its speed figure is the one `make bench` wrote, with its date and command."""

import json
import re
import subprocess
import sys
from urllib.parse import urlsplit

import numpy as np
import pytest

from tests.server import ROOT, running_service

README = (ROOT / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:30])


def block(language: str, containing: str) -> str:
    """The README's fenced block of `language` that contains `containing`."""
    found = [b for b in re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M) if containing in b]
    assert len(found) == 1, (language, containing)
    return found[0]


def test_the_readme_is_short_and_its_first_screen_says_how_to_run_it():
    assert len(README.splitlines()) <= 200
    assert "make serve" in FIRST_SCREEN and "make test" in FIRST_SCREEN
    assert "127.0.0.1:8000" in FIRST_SCREEN and "ATTEND_PORT=8080 make serve" in FIRST_SCREEN


def test_the_readmes_speed_figure_is_make_benchs_with_its_date_and_command():
    section = README.split("<!-- bench-headline -->\n", 1)[1].split("<!-- /bench-headline -->", 1)[0]
    assert re.match(r"Run 20\d\d-\d\d-\d\d \d\d:\d\d UTC on .*; command: `python bench/run.py ", section)
    assert re.search(r"\*\*\d+ requests/s\*\* from the service on one core, against \*\*\d+\*\* from the plain",
                     section)


@pytest.fixture(scope="module")
def service(repository):
    with running_service(repository, ATTEND_INTRA_OP_THREADS="1") as (url, _):
        yield url


@pytest.mark.slow
def test_the_readmes_curl_call_prints_the_answer_it_shows(service):
    command = block("sh", "curl -s localhost:8000/attend").replace("localhost:8000", urlsplit(service).netloc)
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads(block("json", '"model":"dot_product"'))


@pytest.mark.slow
def test_the_readmes_tritonclient_call_prints_the_books_numbers(service):
    code = block("python", "tritonclient.http") + (
        'print("json:", __import__("json").dumps([result.as_numpy("outputs").tolist(), '
        'result.as_numpy("attention_weights").tolist()]))\n')
    code = code.replace('"127.0.0.1:8000"', repr(urlsplit(service).netloc))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    outputs, weights = json.loads(result.stdout.split("json: ", 1)[1])
    np.testing.assert_allclose(outputs, [[[1, 2]], [[2, 3]]], rtol=1e-6)
    np.testing.assert_allclose(weights, [[[0.5, 0.5, 0]], [[1 / 3] * 3]], rtol=1e-6)
