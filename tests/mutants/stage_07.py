"""Stage 07 mutants: the chained hash (chain_hash) and the prefix-caching block manager
(PrefixBlockManager), one learner bug each."""

from __future__ import annotations

from tests.mutants import maker

FORGET_FRESH = "for block_id in fresh:\n    self._forget(block_id)"


mutant = maker(7)


MUTANTS = (
    # ---- chain_hash ----
    mutant(
        "hash_ignores_the_parent",
        "chain_hash digests the block's tokens only: the same page "
        "after another prefix gets the same key",
        "chain_hash",
        ("hashlib.blake2b(parent, digest_size=16)", "hashlib.blake2b(b'', digest_size=16)"),
    ),
    mutant(
        "hash_of_digits",
        "chain_hash glues the token ids' digits into one string: (1, 23) and (12, 3) collide",
        "chain_hash",
        (
            'digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids))',
            'digest.update("".join(str(t) for t in token_ids).encode())',
        ),
    ),
    mutant(
        "hash_of_low_16_bits",
        "chain_hash packs each token id in two bytes, masking larger ids",
        "chain_hash",
        ('t.to_bytes(8, "little", signed=True)', '(t & 0xFFFF).to_bytes(2, "little")'),
    ),
    # ---- finding the cached prefix ----
    mutant(
        "fully_cached_prompt_computes_nothing",
        "the lookup may reach the block of the last "
        "token: a fully cached prompt is left with nothing to compute and sample from",
        "PrefixBlockManager.cached_prefix",
        ("(len(seq) - 1) // self.block_size", "len(seq) // self.block_size"),
    ),
    mutant(
        "hit_trusted_on_the_key",
        "a hit is taken on the key alone: a colliding key serves another prompt's K/V",
        "PrefixBlockManager.cached_prefix",
        ("entry is None or entry.token_ids != tokens or entry.parent != parent", "entry is None"),
    ),
    mutant(
        "hit_checks_tokens_not_the_prefix",
        "a hit is confirmed by the block's own tokens only: "
        "under a key blind to the parent, a page is served behind another prefix",
        "PrefixBlockManager.cached_prefix",
        (
            "entry is None or entry.token_ids != tokens or entry.parent != parent",
            "entry is None or entry.token_ids != tokens",
        ),
    ),
    mutant(
        "parent_link_without_version",
        "a block's parent link is the parent's block id alone: once that block is "
        "handed out and hashed anew, a page behind its old content still matches behind the "
        "new content (under a key blind to the parent)",
        "PrefixBlockManager",  # cached_prefix and hash_blocks record the link alike
        (
            "parent, parent_key = (block_id, entry.version), key",
            "parent, parent_key = block_id, key",
        ),
        ("parent = (prev_id, self.cached[prev_id].version)", "parent = prev_id"),
        ("parent = (block_id, entry.version)", "parent = block_id"),
        (
            'self.cached[parent[0]].key if parent else b""',
            'self.cached[parent].key if parent is not None else b""',
        ),
    ),
    # ---- admission ----
    mutant(
        "reclaimed_hit_counted_as_free",
        "can_allocate treats a freed cached block like a "
        "shared one: reclaiming it seems to cost no free block",
        "PrefixBlockManager._admission",
        ("reclaimed = sum(1 for b in hits if self.ref_counts[b] == 0)", "reclaimed = 0"),
    ),
    mutant(
        "shared_hit_not_credited",
        "can_allocate still asks for a free block for every block, "
        "as stage 04 did, even those a live sequence shares",
        "PrefixBlockManager._admission",
        (
            "blocks_for(len(seq), self.block_size) - len(hits) + reclaimed",
            "blocks_for(len(seq), self.block_size)",
        ),
    ),
    mutant(
        "reclaimed_block_left_on_the_free_list",
        "allocate reclaims a freed cached block "
        "without taking it off the free list: the next allocation hands it out again",
        "PrefixBlockManager.allocate",
        ("self.allocator.take(block_id)", "pass"),
    ),
    mutant(
        "hashed_in_allocate",
        "allocate indexes the prompt's full blocks at once, before the "
        "forward pass has written their K/V",
        "PrefixBlockManager.allocate",
        (
            "num_cached_tokens = len(hits) * self.block_size",
            "seq.num_cached_tokens = len(seq)  # index the full blocks right away\n"
            "self.hash_blocks(seq)\n"
            "num_cached_tokens = len(hits) * self.block_size",
        ),
    ),
    mutant(
        "allocate_writes_the_count_itself",
        "allocate sets seq.num_cached_tokens (the old contract) and returns nothing",
        "PrefixBlockManager.allocate",
        ("return num_cached_tokens", "seq.num_cached_tokens = num_cached_tokens"),
    ),
    # ---- stale entries ----
    mutant(
        "stale_entry_kept_by_allocate",
        "a block handed out for new content keeps its old "
        "index entry: its old prefix is served from the new K/V",
        "PrefixBlockManager.allocate",
        ("self._grow(seq, table)", "super()._grow(seq, table)"),
    ),
    mutant(
        "stale_entry_kept_by_decode_growth",
        "may_append pulls a block without dropping its old index entry (only allocate drops them)",
        "PrefixBlockManager",  # _grow, which may_append calls, and allocate
        (FORGET_FRESH, ""),
        ("self._grow(seq, table)", f"fresh = self._grow(seq, table)\n{FORGET_FRESH}"),
    ),
    # ---- hashing ----
    mutant(
        "partial_block_hashed",
        "hash_blocks indexes the partial last block too, and never again once a decode fills it",
        "PrefixBlockManager.hash_blocks",
        ("seq.num_cached_tokens // bs", "-(-seq.num_cached_tokens // bs)"),
    ),
    # ---- release ----
    mutant(
        "shared_block_freed",
        "deallocate frees every block of the sequence, even one another sequence still holds",
        "PrefixBlockManager.deallocate",
        (
            "[b for b in reversed(block_ids) if self.ref_counts[b] == 0]",
            "list(reversed(block_ids))",
        ),
    ),
    mutant(
        "shared_count_not_dropped",
        "deallocate zeroes the counts of the blocks it held alone "
        "but leaves a shared block's count as it was (preemption leaks it)",
        "PrefixBlockManager.deallocate",  # its own release, in place of stage 04's _release
        (
            "block_ids = self._release(seq)",
            "block_ids = self.tables.pop(seq.seq_id).release()\n"
            "for block_id in block_ids:\n"
            "    if self.ref_counts[block_id] == 1:\n"
            "        self.ref_counts[block_id] = 0\n"
            "seq.block_table = []",
        ),
    ),
    mutant(
        "released_in_table_order",
        "deallocate walks the table first block first, as stage 04 "
        "did, not last block first as the seed's release does",
        "PrefixBlockManager.deallocate",
        ("reversed(block_ids)", "block_ids"),
    ),
)
