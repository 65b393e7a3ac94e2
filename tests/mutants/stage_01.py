"""Stage 01 mutants: slab bookkeeping (engine/slab_manager.py) and slab reads and writes
(cache/contiguous.py), one realistic learner bug each."""

from __future__ import annotations

from tests.mutants import Mutant

SLABS, SLAB_IO = "nanoserve.engine.slab_manager", "nanoserve.cache.contiguous"


def mutant(name: str, bug: str, module: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(1, name, bug, module, edits)


MUTANTS = (
    mutant(
        "free_list_not_reversed", "the free stack is filled 0..n-1, so pop() hands out n-1 first",
        SLABS, ("list(range(num_slabs - 1, -1, -1))", "list(range(num_slabs))"),
    ),
    mutant(
        "can_allocate_off_by_one", "can_allocate says yes with no slab free",
        SLABS, ("return self.num_free_slabs > 0", "return self.num_free_slabs >= 0"),
    ),
    mutant(
        "can_append_needs_a_free_slab", "can_append copies can_allocate: no decode on a full pool",
        SLABS, ("        return True\n\n    def may_append",
                "        return self.num_free_slabs > 0\n\n    def may_append"),
    ),
    mutant(
        "deallocate_keeps_num_cached_tokens", "deallocate forgets to reset num_cached_tokens",
        SLABS, ("seq.slab_id, seq.num_cached_tokens = None, 0", "seq.slab_id = None"),
    ),
    mutant(
        "deallocate_keeps_the_slab", "deallocate clears seq.slab_id but never returns the slab",
        SLABS, ("        self.free_slab_ids.append(seq.slab_id)\n", ""),
    ),
    mutant(
        "may_append_counts_cached_tokens", "may_append bumps num_cached_tokens (the engine's job)",
        SLABS, ('"""Nothing to do: growth stays inside the slab."""',
                '"""Nothing to do: growth stays inside the slab."""\n'
                "        seq.num_cached_tokens += 1"),
    ),
    mutant(
        "store_into_a_copy", "store_slab writes into a clone, so the engine's cache never changes",
        SLAB_IO, ("    cache[slab_id, start : start + values.shape[0]] = values",
                  "    cache = cache.clone()\n"
                  "    cache[slab_id, start : start + values.shape[0]] = values"),
    ),
    mutant(
        "store_one_position_late", "store_slab writes token i at start + i + 1 (1-based positions)",
        SLAB_IO, ("cache[slab_id, start : start + values.shape[0]] = values",
                  "cache[slab_id, start + 1 : start + 1 + values.shape[0]] = values"),
    ),
    mutant(
        "load_includes_end", "load_slab returns positions 0..end inclusive",
        SLAB_IO, ("return cache[slab_id, :end]", "return cache[slab_id, : end + 1]"),
    ),
    mutant(
        "load_drops_the_newest", "load_slab stops one short: the token just stored is not read",
        SLAB_IO, ("return cache[slab_id, :end]", "return cache[slab_id, : end - 1]"),
    ),
)  # fmt: skip
