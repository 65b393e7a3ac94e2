"""`python -m tests.mutants [--write] [STAGE ...]`: grade every mutant, print which test killed it
and the score per stage. The same runs as tests/test_mutants.py, two at a time: each recorded
killer (killers.txt) runs first. `--write` records this run's killers there for the next runs."""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nanoserve.check_records import Outcome
from tests.mutants import KILLERS_FILE, Mutant, all_mutants, grade, recorded_killers, write_mutant


def killer(mutant: Mutant, folder: Path, first: str | None) -> str | None:
    """The first graded test that failed against the mutant, or None if it survived."""
    results, _, _ = grade(mutant.stage, write_mutant(mutant, folder), first=first)
    failed = [r for r in results if r.outcome is Outcome.FAILED]
    return failed[0].nodeid.rsplit("::", 1)[-1] if failed else None


def main(args: list[str]) -> int:
    write = "--write" in args
    stages = [int(arg) for arg in args if arg != "--write"]
    mutants = [m for m in all_mutants() if not stages or m.stage in stages]
    recorded = recorded_killers()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        killers = list(pool.map(lambda m: killer(m, Path(tmp), recorded.get(m.id)), mutants))
    total, killed = Counter(), Counter()
    for mutant, test in zip(mutants, killers):
        total[mutant.stage] += 1
        killed[mutant.stage] += test is not None
        news = "" if test is None or recorded.get(mutant.id) == test else "  (not the recorded one)"
        print(f"{mutant.id:<55} {'SURVIVED' if test is None else 'killed by ' + test}{news}")
    for stage in sorted(total):
        print(f"stage {stage:02d}: {killed[stage]}/{total[stage]} mutants killed")
    print(f"{len(mutants)} mutants in {time.perf_counter() - start:.0f} s")
    if write:
        write_killers({**recorded, **{m.id: t for m, t in zip(mutants, killers) if t}})
    return 0 if killed == total else 1


def write_killers(killers: dict[str, str]) -> None:
    """killers.txt for every mutant that still exists, in the order of all_mutants()."""
    lines = [f"{m.id} {killers[m.id]}" for m in all_mutants() if m.id in killers]
    KILLERS_FILE.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"wrote {KILLERS_FILE} ({len(lines)} mutants)")


HEADER = """\
# mutant, then the graded test that killed it: `python -m tests.mutants --write` wrote this file,
# and each graded run of a mutant starts with that test (-x stops there when it fails)
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
