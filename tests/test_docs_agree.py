"""The prose agrees with the code: what the pages say about the stages, the command line and the
extras is read from the manifest, the CLI's parser and pyproject.toml, so a page cannot drift.

The docs tests (test_docs.py) run the pages' code; these read their words: how many stages there
are and what they are called, whether a stage is implemented, every subcommand and flag in the
command-line synopsis, and what the notebooks need to run.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from nanoserve.cli import build_parser
from nanoserve.stages import STAGES, StageStatus

ROOT = Path(__file__).resolve().parents[1]
NUMBER_WORDS = [
    *("zero", "one", "two", "three", "four", "five", "six"),
    *("seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen"),
]
# Pages a learner reads day by day: the site's own pages and every lesson.
LEARNER_PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "docs/stages").glob("*.md"),
        *(ROOT / "stages").glob("*/README.md"),
    ]
)


def page(relative: str) -> str:
    return (ROOT / relative).read_text()


def fenced_block_after(text: str, heading: str) -> str:
    """The first fenced block after a heading line."""
    rest = text[text.index(heading) :]
    start = rest.index("```")
    start = rest.index("\n", start) + 1
    return rest[start : rest.index("```", start)]


# ---- how many stages, named and numbered as the manifest says ----


def test_every_stage_count_in_words_is_the_manifests():
    expected = NUMBER_WORDS[len(STAGES)]
    counted = re.compile(r"\bin (" + "|".join(NUMBER_WORDS) + r")( ordered)? stages\b", re.I)
    for path in LEARNER_PAGES:
        for match in counted.finditer(path.read_text()):
            assert match[1].lower() == expected, (
                f"{path.relative_to(ROOT)} says {match[0]!r}; the manifest has {len(STAGES)} "
                f"stages ({expected})"
            )


def test_the_stage_numbering_the_pages_state_is_the_manifests():
    first, last = f"{STAGES[0].number:02d}", f"{STAGES[-1].number:02d}"
    stated = {
        "docs/index.md": rf"numbered `{first}` to `{last}`",
        "docs/glossary.md": rf"numbered {first} to {last}",
        "docs/syllabus.md": rf"Every stage, {first} to {last}, is implemented",
    }
    all_implemented = all(s.is_implemented for s in STAGES)
    for relative, phrase in stated.items():
        if relative == "docs/syllabus.md" and not all_implemented:
            assert "Every stage" not in page(relative), "the syllabus says every stage is done"
            continue
        assert re.search(phrase, page(relative)), f"{relative} must say {phrase!r}"


def test_the_syllabus_has_one_section_per_stage_with_the_manifests_title_in_order():
    headings = re.findall(
        r"^## Stage (\d\d) · (.+?) \(days? [\d–]+\)$", page("docs/syllabus.md"), re.M
    )
    assert headings == [(f"{s.number:02d}", s.title) for s in STAGES if s.is_implemented]


def test_the_syllabus_day_count_in_words_matches_its_days():
    text = page("docs/syllabus.md")
    days = [int(n) for n in re.findall(r"^### Day (\d+):", text, re.M)]
    assert days == list(range(1, len(days) + 1)), "days are numbered 1, 2, 3, ... in order"
    assert text.startswith(f"# Syllabus\n\n{spelled(len(days))} days,"), text[:40]


def spelled(n: int) -> str:
    """1..49 in words, capitalized: 28 -> 'Twenty-eight'."""
    if n < len(NUMBER_WORDS):
        return NUMBER_WORDS[n].capitalize()
    tens = {2: "Twenty", 3: "Thirty", 4: "Forty"}[n // 10]
    return tens + (f"-{NUMBER_WORDS[n % 10]}" if n % 10 else "")


def test_no_page_calls_an_implemented_stage_planned():
    if any(s.status is StageStatus.PLANNED for s in STAGES):
        pytest.skip("a stage is planned: the word is allowed")  # pragma: no cover
    for path in LEARNER_PAGES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"\bplanned\b", line, re.I), (
                f"{path.relative_to(ROOT)}:{number} speaks of a planned stage, but every stage "
                f"of the manifest is implemented: {line.strip()}"
            )


# ---- the command line, as the parser has it ----


def subcommands() -> dict[str, list[str]]:
    """Subcommand -> its long options, from the CLI's own parser."""
    parser = build_parser()
    (action,) = (a for a in parser._actions if a.dest == "command")  # the subparsers
    return {
        name: sorted(
            {s for a in sub._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
        )
        for name, sub in action.choices.items()
    }


def test_the_getting_started_synopsis_lists_every_subcommand_and_flag():
    synopsis = fenced_block_after(page("docs/getting-started.md"), "## The command line")
    # `[--[no-]enforce-eager]` stands for both `[--enforce-eager]` and `[--no-enforce-eager]`
    synopsis = synopsis.replace("--[no-]", "--") + synopsis.replace("--[no-]", "--no-")
    for name, flags in subcommands().items():
        assert re.search(rf"^nanoserve {name}\b", synopsis, re.M), f"`nanoserve {name}` is missing"
        missing = [f for f in flags if not re.search(rf"\[{re.escape(f)}\b", synopsis)]
        assert not missing, f"the synopsis lacks {name}'s {', '.join(missing)}"


def test_the_readme_shows_every_subcommand():
    readme = page("README.md")
    for name in subcommands():
        if name != "bench":  # shown as `make bench = nanoserve bench ...`
            assert f"nanoserve {name}" in readme, f"the README never shows `nanoserve {name}`"


# ---- the notebooks can be run with what the docs say to install ----


def test_the_notebooks_extra_installs_everything_the_notebooks_import():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    project = tomllib.loads(page("pyproject.toml"))["project"]
    installed = {
        re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower().replace("-", "_")
        for requirement in [
            *project["dependencies"],
            *project["optional-dependencies"]["notebooks"],
        ]
    }
    assert {"jupyterlab", "jupytext"} <= installed, "the extra gives no Jupyter to open them in"
    for notebook in sorted((ROOT / "notebooks").glob("*.py")):
        for module in top_level_imports(notebook):
            assert module in sys.stdlib_module_names or module in {"nanoserve", *installed}, (
                f"{notebook.name} imports {module}, which `pip install -e '.[notebooks]'` does "
                f"not install"
            )
    assert "pip install -e '.[notebooks]'" in page("docs/getting-started.md")


def top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names
