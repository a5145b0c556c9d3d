"""The documentation site (mkdocs.yml, docs/): `mkdocs build --strict` succeeds, so no page has a broken link
or anchor, and no page is left out of the navigation; its key pages exist; the settings page lists every
setting of service/config.py with its default."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import Settings, setting_names
from tests.server import ROOT

DOCS = ROOT / "docs"
PAGES = ["index.html", "setup/index.html", "attend/index.html", "page/index.html", "v2/index.html",
         "grpc/index.html", "models/index.html", "docker/index.html", "kubernetes/index.html", "ray/index.html",
         "settings/index.html", "under-load/index.html", "observability/index.html", "errors/index.html",
         "reliability/index.html", "troubleshooting/index.html", "benchmarks/index.html", "archive/index.html",
         "layout/index.html"]


def build(site: Path, docs_dir: Path | None = None) -> subprocess.CompletedProcess:
    config = ROOT / "mkdocs.yml"
    if docs_dir is not None:  # the same config over another folder of pages
        text = config.read_text().replace("docs_dir: docs", f"docs_dir: {docs_dir}")
        config = docs_dir.parent / "mkdocs.yml"
        config.write_text(text)
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly_with_its_key_pages(tmp_path):
    site = tmp_path / "site"
    result = build(site)
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    missing = [page for page in PAGES if not (site / page).is_file()]
    assert missing == []
    # The performance page holds every section a bench command writes, markers included.
    performance = (DOCS / "benchmarks.md").read_text()
    for marker in ("bench", "where", "breakdown", "grpc-floor", "grpc-listening", "bench-gpu", "compute"):
        assert performance.count(f"<!-- {marker} -->") == 1 and performance.count(f"<!-- /{marker} -->") == 1, marker


def test_a_broken_link_fails_the_build(tmp_path):
    """What --strict is for: a link to a page that does not exist stops the build."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(DOCS), str(docs)], check=True)
    page = docs / "setup.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    result = build(tmp_path / "site", docs)
    assert result.returncode != 0 and "no-such-page.md" in result.stderr


def _shown(default) -> str:
    """A default as the settings page writes it."""
    if default is None:
        return "(none)"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    text = str(default)
    return text if text and "*" not in text else "(none)"  # SecretStr prints as stars


def test_the_settings_page_lists_every_setting_with_its_default():
    rows = re.findall(r"^\| `(ATTEND_[A-Z0-9_]+)` \| ([^|]+) \|", (DOCS / "settings.md").read_text(), re.M)
    documented = {name: default.strip() for name, default in rows}
    assert len(rows) == len(documented), "a setting is listed twice"
    assert set(documented) == set(setting_names())
    for name, field in Settings.model_fields.items():
        assert documented[f"ATTEND_{name.upper()}"] == _shown(field.default), name


USER_PAGES = ["index.md", "setup.md", "attend.md", "page.md", "v2.md", "grpc.md", "models.md", "docker.md",
              "kubernetes.md", "ray.md", "settings.md", "under-load.md", "troubleshooting.md"]


@pytest.mark.parametrize("page", USER_PAGES)
def test_the_prose_of_a_users_page_comes_in_short_lines(page):
    """Short sentences, one idea each: outside code blocks and tables no line runs past 120 characters."""
    long, code = [], False
    for line in (DOCS / page).read_text().splitlines():
        code = code != line.lstrip().startswith("```")
        if not code and not line.lstrip().startswith(("|", "```", "![")) and len(line) > 120:
            long.append(line)
    assert long == []
