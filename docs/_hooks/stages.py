"""MkDocs hook: render the stage tables from `src/nanoserve/stages.py`, the manifest.

The docs never hard-code a stage's title or status: a page writes a marker such as
`<!-- stages:table -->` on a line of its own and this hook swaps in a table built from `STAGES`.
It also warns (so `mkdocs build --strict` fails) when an implemented stage has no docs page.
"""

from __future__ import annotations

import importlib.util
import logging
import posixpath
import sys
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.stages")

MANIFEST = Path(__file__).resolve().parents[2] / "src" / "nanoserve" / "stages.py"


def _load_manifest():
    # Load stages.py by path: importing the `nanoserve` package would pull in torch for nothing.
    spec = importlib.util.spec_from_file_location("_nanoserve_stages_for_docs", MANIFEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module.STAGES


STAGES = _load_manifest()


def _stage_link(stage, page_dir: str) -> str:
    """The stem, linked (relative to the page's folder) when the stage is implemented."""
    if not stage.is_implemented:
        return f"`{stage.stem}`"
    target = posixpath.relpath(stage.docs_page.removeprefix("docs/"), page_dir)
    return f"[`{stage.stem}`]({target})"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def stage_table(page_dir: str) -> str:
    """Every stage: number, stem, title, what it adds, what it is proven equal to, status."""
    rows = [
        "| # | stem | title | what it adds | proven equal to | status |",
        "|---|---|---|---|---|---|",
    ]
    for s in STAGES:
        status = s.status.value + (" (needs a CUDA GPU)" if s.needs_gpu else "")
        rows.append(
            f"| {s.number:02d} | {_stage_link(s, page_dir)} | {s.title} | {_cell(s.summary)} "
            f"| {_cell(s.proven_equal_to)} | {status} |"
        )
    return "\n".join(rows)


def planned_modules() -> str:
    """The reference modules that planned stages will add, one row per stage."""
    rows = ["| stage | module(s) | what it will own |", "|---|---|---|"]
    for s in STAGES:
        if not s.is_implemented:
            modules = ", ".join(f"`{m}`" for m in s.reference_modules)
            rows.append(f"| {s.number:02d} `{s.stem}` | {modules} | {_cell(s.summary)} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    page_dir = posixpath.dirname(page.file.src_uri) or "."
    markdown = markdown.replace("<!-- stages:table -->", stage_table(page_dir))
    return markdown.replace("<!-- stages:planned-modules -->", planned_modules())


def on_files(files, config, **kwargs):
    for s in STAGES:
        page = s.docs_page.removeprefix("docs/")
        if s.is_implemented and files.get_file_from_path(page) is None:
            log.warning(f"stage {s.number:02d} is implemented but {s.docs_page} does not exist")
    return files
