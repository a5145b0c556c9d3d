"""docs/errors.md's table is the error classes' own: it fails when the file is stale, when a class lacks
what it means (a docstring) or what to do (`advice`), or when a code is written in the service outside
a class the table is made from."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "errors_table.py"


@pytest.fixture(scope="module")
def errors_table():
    spec = importlib.util.spec_from_file_location("errors_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def classes(errors_table):
    return errors_table.error_classes()


def test_docs_errors_md_is_what_the_script_writes():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"{result.stderr}(run: python scripts/errors_table.py)"


def test_the_check_fails_on_a_stale_file(errors_table, tmp_path):
    stale = tmp_path / "errors.md"
    stale.write_text((ROOT / "docs" / "errors.md").read_text().replace("`not_ready`", "`not_redy`"))
    assert errors_table.main(["--check", "--file", str(stale)]) == 1
    assert errors_table.main(["--file", str(stale)]) == 0  # written
    assert errors_table.main(["--check", "--file", str(stale)]) == 0


def test_every_error_says_what_it_means_and_what_to_do(errors_table, classes):
    assert errors_table.missing(classes) == []
    names = {c.__name__ for c in classes}
    # Those beside the code that raises them are found too.
    assert {"ServiceError", "InvalidShape", "Overloaded", "LoadFailed", "InvalidName", "BadRequest",
            "RouteNotFound"} <= names


def test_a_class_without_advice_is_caught(errors_table):
    # Not a ServiceError subclass: one would stay in ServiceError.__subclasses__() for the other tests.
    bare = type("Undocumented", (), {"__module__": "somewhere", "status": 418, "code": "teapot"})
    advised = type("Advised", (bare,), {"__module__": "somewhere", "__doc__": "A teapot."})
    assert errors_table.missing([bare, advised]) == [
        "somewhere.Undocumented has no docstring", "somewhere.Undocumented has no advice",
        "somewhere.Advised has no advice"]


def test_every_code_in_the_service_is_in_the_table(classes):
    """A code written anywhere in service/ (an assignment or a mapping to a string) is a class's."""
    codes = {c.code for c in classes}
    written = set()
    for path in (ROOT / "service").rglob("*.py"):
        text = path.read_text()
        written |= set(re.findall(r'\bcode\s*=\s*(?:\d+\s*,\s*)?"([a-z_]+)"', text))
        written |= set(re.findall(r'status,\s*code\s*=\s*\d+\s*,\s*"([a-z_]+)"', text))
        written |= set(re.findall(r'\bcode\s*=\s*\{[^}]*?:\s*"([a-z_]+)"', text))
    assert written, "the pattern finds the codes of service.core.errors at least"
    assert written <= codes, f"codes outside the error classes: {sorted(written - codes)}"


def test_the_table_has_a_row_for_every_class(classes):
    """A row a class and a class a row, each with its code; the classes found are the service's (a search
    that found none would otherwise leave nothing to compare)."""
    rows = [line for line in (ROOT / "docs" / "errors.md").read_text().splitlines() if line.startswith("| `")]
    listed = [re.fullmatch(r"\| `(\w+)` \|.*\| `(\w+)` \(([\w.]+)\) \|", row).groups() for row in rows]
    assert sorted(listed) == sorted((c.code, c.__name__, c.__module__) for c in classes)
    assert {"ServiceError", "NotReady", "Overloaded", "BadRequest"} <= {c.__name__ for c in classes}
