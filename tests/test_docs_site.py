"""The documentation site builds with ``mkdocs build --strict`` and shows no raw Sphinx roles.

Skipped where mkdocs or mkdocstrings is not installed (``pip install ".[docs]"``) and where
racecpu is installed without its sources (no ``mkdocs.yml`` beside ``tests/``).
"""

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
yaml = pytest.importorskip("yaml")  # mkdocs' own dependency

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"

#: A Sphinx role left in a rendered page (docs/_hooks.py turns them into code spans).
RAW_ROLE = re.compile(r":(func|mod|class|meth):")


def _nav_pages(nav):
    """The Markdown files of mkdocs.yml's nav, in order."""
    for item in nav:
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for value in item.values():
                yield from (_nav_pages(value) if isinstance(value, list) else [value])


def _config():
    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold tags (!ENV, !!python/name) that SafeLoader lacks
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    return yaml.load(CONFIG.read_text(encoding="utf-8"), Loader=Loader)


def _html_path(site, page):
    """Where mkdocs (use_directory_urls) writes ``page``: index.md -> index.html, x.md -> x/index.html."""
    stem = page[:-len(".md")]
    if stem == "index" or stem.endswith("/index"):
        return site / (stem + ".html")
    return site / stem / "index.html"


def test_site_builds_strict(tmp_path):
    if not CONFIG.is_file():
        pytest.skip("racecpu's sources (mkdocs.yml) are not here: installed without them")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"

    pages = list(_nav_pages(_config()["nav"]))
    assert "index.md" in pages and "api.md" in pages
    missing = [p for p in pages if not _html_path(site, p).is_file()]
    assert not missing, f"nav pages missing from the built site: {missing}"

    raw = {}
    for html in site.rglob("*.html"):
        found = RAW_ROLE.findall(html.read_text(encoding="utf-8"))
        if found:
            raw[str(html.relative_to(site))] = len(found)
    assert not raw, f"raw Sphinx roles (:func:, :mod:, :class:, :meth:) in the rendered pages: {raw}"
