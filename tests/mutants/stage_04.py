"""Stage 04 mutants: the block manager (engine/block_manager.py), the pool's write and read
(cache/paged.py) and the step tensors (engine/input_packer.py), one learner bug each."""

from __future__ import annotations

from tests.mutants import Mutant

MANAGER = "nanoserve.engine.block_manager"
POOL = "nanoserve.cache.paged"
STEP = "nanoserve.engine.input_packer"


def mutant(name: str, bug: str, module: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(4, name, bug, module, edits)


MUTANTS = (
    # ---- the block manager ----
    mutant(
        "can_allocate_counts_the_prompt", "can_allocate counts the prompt, not len(seq): a "
        "preempted sequence is admitted short of blocks",
        MANAGER, ("blocks_for(len(seq), self.block_size)",
                  "blocks_for(seq.num_prompt_tokens, self.block_size)"),
    ),
    mutant(
        "can_allocate_strict", "can_allocate needs one block more than the prompt takes",
        MANAGER, ("return self.num_free_blocks >= blocks_for(",
                  "return self.num_free_blocks > blocks_for("),
    ),
    mutant(
        "can_append_seed_modulo", "can_append uses the seed's len(seq) % block_size == 1, which "
        "never asks for a block at block_size 1",
        MANAGER, ("needs_block = table.num_tokens + 1 > len(table.block_ids) * self.block_size",
                  "needs_block = len(seq) % self.block_size == 1"),
    ),
    mutant(
        "can_append_always", "can_append answers True whatever the pool holds",
        MANAGER, ("return self.num_free_blocks >= int(needs_block)", "return True"),
    ),
    mutant(
        "check_fits_ignores_max_tokens", "check_fits checks the prompt only",
        MANAGER, ('        check_blocks_fit(max_num_tokens, "prompt + max_tokens", '
                  "self.block_size, self.num_blocks)\n", ""),
    ),
    mutant(
        "deallocate_keeps_num_cached_tokens", "deallocate forgets num_cached_tokens = 0, so a "
        "preempted sequence is never recomputed",
        MANAGER, ("        seq.num_cached_tokens = 0\n", ""),
    ),
    mutant(
        "deallocate_in_reverse", "deallocate frees the blocks last to first",
        MANAGER, ("self.allocator.free([b for b in block_ids if self.ref_counts[b] == 0])",
                  "self.allocator.free([b for b in block_ids if self.ref_counts[b] == 0][::-1])"),
    ),
    mutant(
        "deallocate_sorted", "deallocate frees the blocks sorted by id, not in table order",
        MANAGER, ("self.allocator.free([b for b in block_ids if self.ref_counts[b] == 0])",
                  "self.allocator.free(sorted(b for b in block_ids if self.ref_counts[b] == 0))"),
    ),
    mutant(
        "check_invariants_does_nothing", "check_invariants is left as a no-op",
        MANAGER, ('"""Assert the bookkeeping is consistent; tests call it after every step."""',
                  '"""Assert the bookkeeping is consistent; tests call it after every step."""\n'
                  "        return"),
    ),
    # ---- store_kvcache and gather_kv ----
    mutant(
        "store_writes_padding", "store_kvcache indexes with -1 too: padding lands in the last slot",
        POOL, ("    keep = slot_mapping >= 0  # -1 marks padding rows that own no slot",
               "    keep = slot_mapping >= -1"),
    ),
    mutant(
        "store_skips_padding_in_k_only", "store_kvcache filters -1 for the keys but not the values",
        POOL, ("v_cache.view(num_slots, *v_cache.shape[2:])[slots] = v[keep]",
               "v_cache.view(num_slots, *v_cache.shape[2:])[slot_mapping] = v"),
    ),
    mutant(
        "store_keys_into_a_copy", "store_kvcache writes the keys into a clone of the cache",
        POOL, ("k_cache.view(num_slots, *k_cache.shape[2:])[slots] = k[keep]",
               "k_cache.clone().view(num_slots, *k_cache.shape[2:])[slots] = k[keep]"),
    ),
    mutant(
        "gather_floor", "gather_kv reads context_len // block_size blocks (floor, not ceil)",
        POOL, ("num_blocks = -(-context_len // cache.shape[1])",
               "num_blocks = context_len // cache.shape[1]"),
    ),
    mutant(
        "gather_in_table_order_reversed", "gather_kv reads the table back to front",
        POOL, ("rows = cache[block_table[:num_blocks]]",
               "rows = cache[block_table[:num_blocks].flip(0)]"),
    ),
    # ---- prepare_prefill and prepare_decode ----
    mutant(
        "cu_seqlens_k_counts_new_tokens", "cu_seqlens_k sums the new tokens, like cu_seqlens_q",
        STEP, ("cu_seqlens_k.append(cu_seqlens_k[-1] + end)",
               "cu_seqlens_k.append(cu_seqlens_k[-1] + end - start)"),
    ),
    mutant(
        "cu_seqlens_q_counts_the_context", "cu_seqlens_q sums len(seq), like cu_seqlens_k",
        STEP, ("cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)",
               "cu_seqlens_q.append(cu_seqlens_q[-1] + end)"),
    ),
    mutant(
        "positions_restart_at_zero", "positions count the new tokens from 0, not from start",
        STEP, ("positions.extend(range(start, end))", "positions.extend(range(end - start))"),
    ),
    mutant(
        "slot_is_the_position", "slot_mapping uses the position itself, ignoring the block table",
        STEP, ("return [table[p // block_size] * block_size + p % block_size "
               "for p in range(start, end)]",
               "return list(range(start, end))"),
    ),
    mutant(
        "slot_forgets_block_size", "slot_mapping adds the offset to the block id, unscaled",
        STEP, ("table[p // block_size] * block_size + p % block_size for p",
               "table[p // block_size] + p % block_size for p"),
    ),
    mutant(
        "prefill_ignores_the_cached_prefix", "prefill packs every token from 0, even a cached "
        "prefix",
        STEP, ("block_size, device, is_prefill=True)",
               "block_size, device, is_prefill=True,\n                     from_start=True)"),
    ),
)  # fmt: skip
