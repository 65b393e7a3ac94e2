"""MkDocs hook: publish the notebooks (`notebooks/NN_slug.py`, jupytext scripts) as site pages.

They live outside `docs/`, so this hook adds each one to the site's files as
`notebooks/NN_slug.py`; the mkdocs-jupyter plugin (mkdocs.yml) then executes it and renders its
text and figures, so a reader sees the pictures without running Jupyter. A notebook left out of
the nav is reported like any page left out (mkdocs.yml's `validation`), so `--strict` fails.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]


@event_priority(100)  # before mkdocs-jupyter's on_files turns them into notebook pages
def on_files(files, config, **kwargs):
    for path in sorted((ROOT / "notebooks").glob("*.py")):
        files.append(
            File(
                f"notebooks/{path.name}",
                src_dir=str(ROOT),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files
