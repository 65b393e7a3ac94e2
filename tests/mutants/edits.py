"""Edits keyed on the syntax tree: a mutant's (old, new) made inside one def or class of a module.

`old` is parsed on its own and looked for among the nodes of the target def or class: one
expression (when `old` is a lone expression) or a run of consecutive statements of one block,
equal when their `ast.dump`s are (read or assigned to alike). It must match exactly once. The
module text from the first matched node's lineno/col_offset to the last one's
end_lineno/end_col_offset is replaced by `new`, whose lines after the first take the indent of
the line the match starts on; an empty `new` deletes the matched statements' lines. So
formatting, comments, line wrapping and every other def of the module do not matter; a change to
the matched code itself is reported, never guessed around.

    target BlockManager.can_append, old "return self.num_free_blocks >= int(needs_block)":

      class BlockManager:              the path's names lead from the top level to the scope
          def can_append(self, seq):   <- the scope: only nodes inside it are candidates
              ...
              return self.num_free_blocks >= int(
                  needs_block          <- wrapped any way: the trees compare equal
              )  # a comment           <- what follows the span on its line stays
"""

from __future__ import annotations

import ast
import re
import textwrap

Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


class EditError(ValueError):
    """An edit that no longer fits the reference: it matches no node or several, or breaks it."""


def find_scope(tree: ast.Module, path: list[str]) -> Scope:
    """The def or class reached from the module's top level through path's names, one per level."""
    node = tree
    for name in path:
        found = [n for n in node.body if isinstance(n, Scope) and n.name == name]
        if len(found) != 1:
            raise EditError(f"{'.'.join(path)}: {len(found)} definitions of {name!r}, not one")
        node = found[0]
    return node


def tree(node: ast.AST) -> str:
    """node's tree without positions, and without load/store contexts: an expression that is
    assigned to (`x[i] = ...`) matches the same text read."""
    return re.sub(r"ctx=(Load|Store|Del)\(\)", "", ast.dump(node))


def matches(scope: Scope, old: str) -> list[tuple[ast.AST, ast.AST]]:
    """(first, last) node of every place in scope whose tree equals old's."""
    pattern = ast.parse(textwrap.dedent(old)).body
    if len(pattern) == 1 and isinstance(pattern[0], ast.Expr):  # one expression: any expression
        wanted = tree(pattern[0].value)
        expressions = (n for n in ast.walk(scope) if isinstance(n, ast.expr))
        return [(n, n) for n in expressions if tree(n) == wanted]
    wanted = [tree(s) for s in pattern]  # statements: a run of them in one block
    runs = statement_runs(scope, len(wanted))
    return [(run[0], run[-1]) for run in runs if [tree(s) for s in run] == wanted]


def statement_runs(scope: Scope, length: int):
    """Every run of `length` consecutive statements of one block (a body, orelse, ...) in scope."""
    for node in ast.walk(scope):
        for _, block in ast.iter_fields(node):
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                for i in range(len(block) - length + 1):
                    yield block[i : i + length]


def offset(lines: list[str], lineno: int, col_offset: int) -> int:
    """Index in the joined text of a node position (col_offset counts UTF-8 bytes, not chars)."""
    line = lines[lineno - 1]
    return sum(map(len, lines[: lineno - 1])) + len(line.encode()[:col_offset].decode())


def replace(source: str, first: ast.AST, last: ast.AST, new: str) -> str:
    """source with the text from first's start to last's end replaced by new, re-indented."""
    lines = source.splitlines(keepends=True)
    start = offset(lines, first.lineno, first.col_offset)
    end = offset(lines, last.end_lineno, last.end_col_offset)
    line_start = offset(lines, first.lineno, 0)
    before = source[line_start:start]  # the indent, or code the match follows on its line
    if not new.strip():  # delete whole lines: only blanks before, only a comment after
        line_end = offset(lines, last.end_lineno, 0) + len(lines[last.end_lineno - 1])
        after = source[end:line_end].strip()
        if before.strip() or (after and not after.startswith("#")):
            raise EditError("only statements alone on their lines can be deleted")
        return source[:line_start] + source[line_end:]
    indent = before[: len(before) - len(before.lstrip())]
    head, *tail = textwrap.dedent(new).strip("\n").split("\n")
    text = "\n".join([head, *(indent + line if line.strip() else line for line in tail)])
    return source[:start] + text + source[end:]


def apply_edit(source: str, path: list[str], old: str, new: str) -> str:
    """source with old, matched once inside the def or class at path, replaced by new."""
    found = matches(find_scope(ast.parse(source), path), old)
    if len(found) != 1:
        raise EditError(f"{old!r} matches {len(found)} times in {'.'.join(path)}, not once")
    edited = replace(source, *found[0], new)
    try:
        ast.parse(edited)
    except SyntaxError as err:
        raise EditError(f"replacing {old!r} by {new!r} leaves invalid Python: {err}") from None
    return edited


def definition_source(source: str, path: list[str]) -> str:
    """The text of the def or class at path, its decorators included."""
    node = find_scope(ast.parse(source), path)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return "".join(source.splitlines(keepends=True)[first - 1 : node.end_lineno])
