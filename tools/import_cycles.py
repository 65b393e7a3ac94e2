"""Print every import cycle in a package (function-level imports included); exit 1 if any.

    python tools/import_cycles.py [package] [--src DIR]

A cycle is a strongly connected group of two or more modules in grimp's import graph (the graph
import-linter checks), counted twice: between modules, and between the package's top-level
parts (nanoserve.cache <-> nanoserve.engine counts even when no single module loops). `make lint`
runs it; DESIGN.md says imports point one way, so both answers should be 0.
"""

from __future__ import annotations

import argparse
import sys

import grimp


def import_edges(package: str, depth: int | None) -> dict[str, set[str]]:
    """module -> modules it imports; with depth, names cut to their first `depth` parts."""
    graph = grimp.build_graph(package, include_external_packages=False)

    def cut(name: str) -> str:
        return name if depth is None else ".".join(name.split(".")[:depth])

    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        targets = {cut(m) for m in graph.find_modules_directly_imported_by(module)}
        edges.setdefault(cut(module), set()).update(targets - {cut(module)})
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of nodes that import each other, directly or through others (Tarjan's SCCs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:  # recursive: the module graph is small and shallow
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(edges.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="nanoserve")
    parser.add_argument("--src", default="src", help="folder that holds the package")
    args = parser.parse_args()
    sys.path.insert(0, args.src)
    found = 0
    for what, depth in (("modules", None), ("top-level parts", 2)):
        cycles = import_cycles(import_edges(args.package, depth))
        for group in cycles:
            print(f"cycle between {what}: " + " <-> ".join(group))
        print(f"{len(cycles)} import cycles between the {what} of {args.package}")
        found += len(cycles)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
