"""`python -m tests.mutants [STAGE ...]`: grade every mutant, print which test killed it and the
score per stage. The same runs as tests/test_mutants.py, two at a time."""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nanoserve.check_records import Outcome
from tests.mutants import Mutant, all_mutants, grade, write_mutant


def killer(mutant: Mutant, folder: Path) -> str | None:
    """The first graded test that failed against the mutant, or None if it survived."""
    results, _, _ = grade(mutant.stage, write_mutant(mutant, folder))
    failed = [r for r in results if r.outcome is Outcome.FAILED]
    return failed[0].nodeid.rsplit("::", 1)[-1] if failed else None


def main(stages: list[int]) -> int:
    mutants = [m for m in all_mutants() if not stages or m.stage in stages]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        killers = list(pool.map(lambda m: killer(m, Path(tmp)), mutants))
    total, killed = Counter(), Counter()
    for mutant, test in zip(mutants, killers):
        total[mutant.stage] += 1
        killed[mutant.stage] += test is not None
        print(f"{mutant.id:<55} {'SURVIVED' if test is None else 'killed by ' + test}")
    for stage in sorted(total):
        print(f"stage {stage:02d}: {killed[stage]}/{total[stage]} mutants killed")
    print(f"{len(mutants)} mutants in {time.perf_counter() - start:.0f} s")
    return 0 if killed == total else 1


if __name__ == "__main__":
    sys.exit(main([int(arg) for arg in sys.argv[1:]]))
