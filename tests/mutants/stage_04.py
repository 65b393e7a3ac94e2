"""Stage 04 mutants: the block manager (BlockManager), the pool's write and read (store_kvcache,
gather_kv) and the step tensors (prepare_prefill and its helpers), one learner bug each."""

from __future__ import annotations

from tests.mutants import maker

STORE_K = "k_cache.view(num_slots, *k_cache.shape[2:])[slots] = k[keep]"
STORE_V = "v_cache.view(num_slots, *v_cache.shape[2:])[slots] = v[keep]"
FREED = "[b for b in block_ids if self.ref_counts[b] == 0]"
PREFILL = "pack_step(seqs, [s.block_table for s in seqs], block_size, device, is_prefill=True)"


mutant = maker(4)


MUTANTS = (
    # ---- the block manager ----
    mutant(
        "can_allocate_counts_the_prompt",
        "can_allocate counts the prompt, not len(seq): a "
        "preempted sequence is admitted short of blocks",
        "BlockManager.can_allocate",
        ("len(seq)", "seq.num_prompt_tokens"),
    ),
    mutant(
        "can_allocate_strict",
        "can_allocate needs one block more than the prompt takes",
        "BlockManager.can_allocate",
        (
            "self.num_free_blocks >= blocks_for(len(seq), self.block_size)",
            "self.num_free_blocks > blocks_for(len(seq), self.block_size)",
        ),
    ),
    mutant(
        "can_append_seed_modulo",
        "can_append uses the seed's len(seq) % block_size == 1, which "
        "never asks for a block at block_size 1",
        "BlockManager.can_append",
        (
            "needs_block = len(seq) > len(table.block_ids) * self.block_size",
            "needs_block = len(seq) % self.block_size == 1",
        ),
    ),
    mutant(
        "can_append_always",
        "can_append answers True whatever the pool holds",
        "BlockManager.can_append",
        ("return self.num_free_blocks >= int(needs_block)", "return True"),
    ),
    mutant(
        "check_fits_ignores_max_tokens",
        "check_fits checks the prompt only",
        "BlockManager.check_fits",
        (
            'check_blocks_fit(max_num_tokens, "prompt + max_tokens", '
            "self.block_size, self.num_blocks)",
            "",
        ),
    ),
    mutant(
        "deallocate_resets_num_cached_tokens",
        "deallocate also zeroes num_cached_tokens, the scheduler's field (the old contract)",
        "BlockManager._release",
        ("seq.block_table = []", "seq.block_table = []\nseq.num_cached_tokens = 0"),
    ),
    mutant(
        "allocate_counts_full_blocks_as_cached",
        "allocate answers the tokens of the full blocks it handed out, as if they were a "
        "cached prefix: the prefill skips them",
        "BlockManager.allocate",
        ("return 0", "return len(seq) // self.block_size * self.block_size"),
    ),
    mutant(
        "deallocate_in_reverse",
        "deallocate frees the blocks last to first",
        "BlockManager.deallocate",
        (FREED, f"{FREED}[::-1]"),
    ),
    mutant(
        "deallocate_sorted",
        "deallocate frees the blocks sorted by id, not in table order",
        "BlockManager.deallocate",
        (FREED, "sorted(b for b in block_ids if self.ref_counts[b] == 0)"),
    ),
    mutant(
        "check_invariants_does_nothing",
        "check_invariants is left as a no-op",
        "BlockManager.check_invariants",
        ("held = [0] * self.num_blocks", "return\nheld = [0] * self.num_blocks"),
    ),
    # ---- store_kvcache and gather_kv ----
    mutant(
        "store_writes_padding",
        "store_kvcache indexes with -1 too: padding lands in the last slot",
        "store_kvcache",
        ("slot_mapping >= 0", "slot_mapping >= -1"),
    ),
    mutant(
        "store_skips_padding_in_k_only",
        "store_kvcache filters -1 for the keys but not the values",
        "store_kvcache",
        (STORE_V, "v_cache.view(num_slots, *v_cache.shape[2:])[slot_mapping] = v"),
    ),
    mutant(
        "store_keys_into_a_copy",
        "store_kvcache writes the keys into a clone of the cache",
        "store_kvcache",
        (STORE_K, STORE_K.replace("k_cache.view", "k_cache.clone().view")),
    ),
    mutant(
        "gather_floor",
        "gather_kv reads context_len // block_size blocks (floor, not ceil)",
        "gather_kv",
        ("-(-context_len // cache.shape[1])", "context_len // cache.shape[1]"),
    ),
    mutant(
        "gather_in_table_order_reversed",
        "gather_kv reads the table back to front",
        "gather_kv",
        ("block_table[:num_blocks]", "block_table[:num_blocks].flip(0)"),
    ),
    # ---- prepare_prefill and prepare_decode (pack_rows packs, slots_for translates) ----
    mutant(
        "cu_seqlens_k_counts_new_tokens",
        "cu_seqlens_k sums the new tokens, like cu_seqlens_q",
        "pack_rows",
        ("cu_seqlens_k[-1] + end", "cu_seqlens_k[-1] + end - start"),
    ),
    mutant(
        "cu_seqlens_q_counts_the_context",
        "cu_seqlens_q sums len(seq), like cu_seqlens_k",
        "pack_rows",
        ("cu_seqlens_q[-1] + end - start", "cu_seqlens_q[-1] + end"),
    ),
    mutant(
        "positions_restart_at_zero",
        "positions count the new tokens from 0, not from start",
        "pack_rows",
        ("range(start, end)", "range(end - start)"),
    ),
    mutant(
        "slot_is_the_position",
        "slot_mapping uses the position itself, ignoring the block table",
        "slots_for",
        (
            "[table[p // block_size] * block_size + p % block_size for p in range(start, end)]",
            "list(range(start, end))",
        ),
    ),
    mutant(
        "slot_forgets_block_size",
        "slot_mapping adds the offset to the block id, unscaled",
        "slots_for",
        ("table[p // block_size] * block_size", "table[p // block_size]"),
    ),
    mutant(
        "prefill_ignores_the_cached_prefix",
        "prefill packs every token from 0, even a cached prefix",
        "prepare_prefill",
        (PREFILL, PREFILL.replace("=True)", "=True, from_start=True)")),
    ),
)
