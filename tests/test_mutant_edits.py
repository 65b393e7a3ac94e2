"""A mutant's edits survive a reformatted reference: they are matched on the syntax tree.

Fast (no graded run): each edit is made on a reference and on the same reference rewrapped,
commented or run through `ruff format`, and both must give the same program.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys

import pytest

import tests.mutants
from tests.mutants import all_mutants, mutated_source
from tests.mutants.edits import EditError, apply_edit

PLAIN = """
class Pool:
    def take(self, n):
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        ids = [self.free.pop() for _ in range(n)]
        return ids


def elsewhere(self, n):
    return n > self.num_free
"""
# the same program: comments, and lines wrapped every way ruff or a person might
REWRAPPED = """
class Pool:
    def take(self, n):
        # Check first: a partial grab would strand blocks.
        if (
            n
            > self.num_free
        ):  # refuse
            raise OutOfBlocks(
                n, self.num_free,
            )
        ids = [
            self.free.pop()  # LIFO
            for _ in range(n)
        ]
        return ids  # in the order popped


def elsewhere(self, n):
    return n > self.num_free
"""
CHECK = "if n > self.num_free:\n    raise OutOfBlocks(n, self.num_free)"
POP = "ids = [self.free.pop() for _ in range(n)]"
EDITS = {
    # `elsewhere` holds the same expression: only the target's own nodes are candidates
    "an expression": ("n > self.num_free", "n >= self.num_free"),
    "a statement": ("return ids", "return ids[::-1]"),
    "a run of statements": (
        f"{CHECK}\n{POP}",
        f"{POP}\nif len(ids) < n:\n    raise OutOfBlocks(n, self.num_free)",
    ),
    "a deletion": (CHECK, ""),
    "a statement made two": (POP, f"{POP}\nids.sort()"),
}


def program(source: str) -> str:
    return ast.dump(ast.parse(source))


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_an_edit_of_a_rewrapped_commented_def_makes_the_same_program(edit):
    old, new = edit
    plain = apply_edit(PLAIN, ["Pool", "take"], old, new)
    assert program(plain) == program(apply_edit(REWRAPPED, ["Pool", "take"], old, new))
    assert program(plain) != program(PLAIN)


def test_an_edit_replaces_the_matched_span_and_indents_the_new_lines_to_it():
    old, new = EDITS["a run of statements"]
    assert apply_edit(REWRAPPED, ["Pool", "take"], old, new) == REWRAPPED.replace(
        REWRAPPED[REWRAPPED.index("if (") : REWRAPPED.index("        return ids")],
        "ids = [self.free.pop() for _ in range(n)]\n"
        "        if len(ids) < n:\n"
        "            raise OutOfBlocks(n, self.num_free)\n",
    )


def test_an_edit_that_matches_no_node_or_several_says_so():
    with pytest.raises(EditError, match=r"matches 0 times in Pool\.take"):
        apply_edit(PLAIN, ["Pool", "take"], "n < self.num_free", "True")
    with pytest.raises(EditError, match=r"matches 2 times in Pool\.take"):
        apply_edit(PLAIN, ["Pool", "take"], "self.num_free", "0")
    with pytest.raises(EditError, match="invalid Python"):
        apply_edit(PLAIN, ["Pool", "take"], "raise OutOfBlocks(n, self.num_free)", "")


def ruff_format(source: str, line_length: int) -> str:
    """source with any `# fmt: skip` dropped, then run through `ruff format`."""
    unskipped = re.sub(r"\s*# fmt: skip$", "", source, flags=re.MULTILINE)
    command = [sys.executable, "-m", "ruff", "format", "--line-length", str(line_length), "-"]
    done = subprocess.run(command, input=unskipped, capture_output=True, text=True, check=True)
    return done.stdout


@pytest.mark.parametrize("line_length", [80, 60])  # the tree itself is formatted at 100
def test_every_mutant_makes_the_same_program_from_the_reference_ruff_formatted(
    line_length, monkeypatch
):
    pytest.importorskip("ruff")
    programs = {m.id: program(mutated_source(m)) for m in all_mutants()}
    reference_source = tests.mutants.reference_source
    formatted = functools.cache(lambda module: ruff_format(reference_source(module), line_length))
    monkeypatch.setattr(tests.mutants, "reference_source", formatted)
    changed = [m.id for m in all_mutants() if program(mutated_source(m)) != programs[m.id]]
    assert not changed
    assert formatted("nanoserve.engine.memory.block_manager") != reference_source(
        "nanoserve.engine.memory.block_manager"
    )  # the test reformatted something
