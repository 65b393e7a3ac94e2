"""The site works offline and shows every stage: mermaid is served from docs/, and each
implemented stage's page shows a figure (drawn by tools/stage_figures.py, small enough to ship)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nanoserve.stages import STAGES, StageStatus

ROOT = Path(__file__).resolve().parents[1]
IMAGE = re.compile(r"!\[[^\]]+\]\((?P<src>[^)\s]+)\)")  # ![alt](src): an image with alt text
MAX_IMAGE_BYTES = 100_000
CDN = re.compile(r"(unpkg\.com|cdn\.jsdelivr\.net|cdnjs\.cloudflare\.com)/[^\"'\s]*mermaid")


class _Loader(yaml.SafeLoader):
    """mkdocs.yml has !ENV and !!python/name tags: read them as plain values."""


_Loader.add_multi_constructor("", lambda loader, suffix, node: None)


def mkdocs_config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)


def test_mermaid_is_served_by_the_site_itself():
    scripts = mkdocs_config().get("extra_javascript", [])
    assert "javascripts/mermaid.min.js" in scripts
    script = ROOT / "docs/javascripts/mermaid.min.js"
    # mkdocs-material fetches mermaid@11 from a CDN unless a `mermaid` global is already there
    head = script.read_bytes()[:200_000].decode(errors="replace")
    assert ".mermaid=" in head, "not mermaid's browser bundle (it sets the global `mermaid`)"
    assert re.search(r'version:"11\.', script.read_text()), "mkdocs-material expects mermaid 11"
    assert (ROOT / "docs/javascripts/mermaid.LICENSE").is_file()


def test_no_page_or_setting_loads_mermaid_from_a_cdn():
    sources = [
        ROOT / "mkdocs.yml",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "docs").rglob("*.html"),
    ]
    for path in sources:
        assert not CDN.search(path.read_text()), path


IMPLEMENTED = [s for s in STAGES if s.status is StageStatus.IMPLEMENTED]


@pytest.mark.parametrize("stage", IMPLEMENTED, ids=lambda s: s.stem)
def test_every_implemented_stage_page_shows_a_small_figure(stage):
    page = ROOT / stage.docs_page
    images = [m["src"] for m in IMAGE.finditer(page.read_text())]
    assert images, f"{stage.docs_page} shows no figure (tools/stage_figures.py draws them)"
    for src in images:
        image = (page.parent / src).resolve()
        assert image.is_file(), f"{stage.docs_page}: {src} does not exist"
        assert image.stat().st_size < MAX_IMAGE_BYTES, f"{src} is over {MAX_IMAGE_BYTES} bytes"


def test_the_figure_script_redraws_every_figure_the_pages_show(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "tools/stage_figures.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    shown = {
        Path(m["src"]).name
        for page in (ROOT / "docs/stages").glob("*.md")
        for m in IMAGE.finditer(page.read_text())
        if "figures/" in m["src"]
    }
    drawn = {p.name for p in tmp_path.glob("*.svg")}
    assert shown and shown <= drawn, shown - drawn
    committed = {p.name for p in (ROOT / "docs/figures").glob("*.svg")}
    assert drawn == committed, "run tools/stage_figures.py and commit docs/figures"
