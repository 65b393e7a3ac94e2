"""Stage 01 mutants: slab bookkeeping (SlabManager) and slab reads and writes (store_slab,
load_slab), one realistic learner bug each."""

from __future__ import annotations

from tests.mutants import maker

STORE = "cache[slab_id, start : start + values.shape[0]] = values"


mutant = maker(1)


MUTANTS = (
    mutant(
        "free_list_not_reversed",
        "the free stack is filled 0..n-1, so pop() hands out n-1 first",
        "SlabManager.__init__",
        ("list(range(num_slabs - 1, -1, -1))", "list(range(num_slabs))"),
    ),
    mutant(
        "can_allocate_off_by_one",
        "can_allocate says yes with no slab free",
        "SlabManager.can_allocate",
        ("self.num_free_slabs > 0", "self.num_free_slabs >= 0"),
    ),
    mutant(
        "can_append_needs_a_free_slab",
        "can_append copies can_allocate: no decode on a full pool",
        "SlabManager.can_append",
        ("return True", "return self.num_free_slabs > 0"),
    ),
    mutant(
        "deallocate_resets_num_cached_tokens",
        "deallocate also zeroes num_cached_tokens, the scheduler's field (the old contract)",
        "SlabManager.deallocate",
        ("seq.slab_id = None", "seq.slab_id, seq.num_cached_tokens = None, 0"),
    ),
    mutant(
        "allocate_returns_nothing",
        "allocate hands out the slab but answers nothing (None), not 0 cached tokens",
        "SlabManager.allocate",
        ("return 0", "return None"),
    ),
    mutant(
        "allocate_counts_the_prompt_as_cached",
        "allocate answers len(seq): the engine then thinks the prompt's K/V is already stored",
        "SlabManager.allocate",
        ("return 0", "return len(seq) - 1"),
    ),
    mutant(
        "deallocate_keeps_the_slab",
        "deallocate clears seq.slab_id but never returns the slab",
        "SlabManager.deallocate",
        ("self.free_slab_ids.append(seq.slab_id)", ""),
    ),
    mutant(
        "may_append_counts_cached_tokens",
        "may_append bumps num_cached_tokens (the engine's job)",
        # the body is its docstring alone: the new line goes after it
        "SlabManager.may_append",
        (
            '"""Nothing to do: growth stays inside the slab."""',
            '"""Nothing to do: growth stays inside the slab."""\nseq.num_cached_tokens += 1',
        ),
    ),
    mutant(
        "store_into_a_copy",
        "store_slab writes into a clone, so the engine's cache never changes",
        "store_slab",
        (STORE, f"cache = cache.clone()\n{STORE}"),
    ),
    mutant(
        "store_one_position_late",
        "store_slab writes token i at start + i + 1 (1-based positions)",
        "store_slab",
        (STORE, "cache[slab_id, start + 1 : start + 1 + values.shape[0]] = values"),
    ),
    mutant(
        "load_includes_end",
        "load_slab returns positions 0..end inclusive",
        "load_slab",
        ("cache[slab_id, :end]", "cache[slab_id, : end + 1]"),
    ),
    mutant(
        "load_drops_the_newest",
        "load_slab stops one short: the token just stored is not read",
        "load_slab",
        ("cache[slab_id, :end]", "cache[slab_id, : end - 1]"),
    ),
)
