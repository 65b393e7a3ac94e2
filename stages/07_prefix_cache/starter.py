"""Stage 07 starter: a block manager that shares full blocks between sequences by their content.

Fill in each body (the lesson, stages/07_prefix_cache/README.md, walks through them in task
order) in a copy: `cp stages/07_prefix_cache/starter.py my_prefix.py`, then grade it with
`pytest stages/07_prefix_cache --impl my_prefix.py`; this file itself must keep failing. Tasks
2-4 are graded together (`-k "task_2 or task_3 or task_4"`): admission can only find blocks that
hash_blocks indexed, and the seed's decode needs may_append; a NotImplementedError names the
method a test reached first. Task 6
plugs your manager into the reference engine (`LLM(stage=7, components=...)`) and demands stage
06's tokens while it computes fewer prompt tokens, with and without preemption.

    A = [11 12 13 14 | 21 22 23 24 | 31 32 33]        hashed after its prefill:
          h0 = H(b"", page 0)  -> block 0               hash_to_block_id = {h0: 0, h1: 1}
          h1 = H(h0,  page 1)  -> block 1               (page 2 is partial: never a key)

    B = [11 12 13 14 | 51 52 53 54 | 61 62 63 64 | 71]  while A is live:
          H(b"", page 0) = h0 -> block 0, tokens match  share it: ref_counts[0] 1 -> 2
          H(h0,  page 1)      -> no entry               stop; fresh blocks for the rest
          B.block_table = [0, 3, 4, 5]   B.num_cached_tokens = 4   prefill computes 9 tokens
"""

from __future__ import annotations

from collections.abc import Callable

from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.memory.kv_manager import Admission, blocks_for, grow_table  # noqa: F401  (tasks 2, 4)
from nanoserve.types import Sequence

# BlockManager above is stage 04's reference. Your class inherits its state and the calls this
# stage does not change (check_fits, can_append, num_free_blocks, check_invariants):
#   self.allocator        stage 02's BlockAllocator; stage 07 gave it take(block_id): hand out
#                         this exact free id (a cached block coming back from the free list)
#   self.table_cls        stage 03's BlockTable; stage 07 gave it adopt(block_ids) (start a
#                         table with whole blocks pulled elsewhere) and release() (empty it and
#                         return the ids, freeing none)
#   self.tables           seq_id -> that sequence's table
#   self.ref_counts       block id -> how many live sequences hold it (0: free)
#   self._hold(block_ids) adds one reference to each
# grow_table(table, n) grows a table to n tokens and returns the ids it pulled (kv_manager.py).
#
# To build on your own stage-04 manager instead, load it by path (base=__file__ finds it next to
# this file) and subclass that; it must keep the same attributes:
#   from nanoserve import grading
#   BlockManager = grading.load_impl(4, "my_pool.py", base=__file__).BlockManager
#
# Admission (given, from the cache-manager seam, kv_manager.py) is what can_allocate returns: a
# NamedTuple (fits: bool, num_cached_blocks: int) that is truthy exactly when it fits, so the
# scheduler's `if manager.can_allocate(seq)` reads it as stage 04's bool.

# ---- task 1: the chained hash ----


def chain_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """The key of one full block: a digest of its parent's key and its own token ids.

    parent is the key of the block before it in the sequence, b"" for the first block. Return
    bytes, at least 16 of them (128 bits: a collision is then astronomically unlikely). Equal
    inputs give equal keys in any process; any change to the parent, to a token or to the order
    of the tokens gives another key. Token ids go up to 151,935 (Qwen's vocabulary).

    Hint: hashlib.blake2b(parent, digest_size=16), then update() it with every token id as a
    fixed-width integer (t.to_bytes(8, "little")). Never str(t) glued together: "1" "23" and
    "12" "3" are the same text. Never Python's hash(): 64 bits, and not meant to resist
    collisions (vLLM moved to sha256 for exactly that; the lesson says why).
    """
    raise NotImplementedError("task 1: chain_hash")


class PrefixBlockManager(BlockManager):
    """Stage 04's block manager plus a content index of full blocks: share live ones, reclaim
    freed ones, and never serve a block whose tokens (or whose prefix) differ.

    The scheduler's calls, for one sequence's life:
      can_allocate(seq) -> allocate(seq)   admission: allocate sets seq.block_table and
                                           returns the shared prefix's tokens (the scheduler
                                           makes that seq.num_cached_tokens)
      hash_blocks(seq)                     after every forward pass that stored K/V for seq,
                                           once seq.num_cached_tokens counts them
      can_append(seq)   -> may_append(seq) before each decode step
      deallocate(seq)                      finish or preemption
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: Callable = chain_hash) -> None:
        """Stage 04's manager (super().__init__(num_blocks, block_size)) plus an empty index.

        Keep hash_fn and use it for every key: the tests pass a deliberately weak one (every
        block the same key, say), and your manager must still never serve a wrong block.
        Hint: hash_to_block_id (key -> block id) and, per hashed block, what it holds: its key,
        its tokens, and which block (and which filling of it) came before it; and, per
        sequence, how far hash_blocks has got (how many of its blocks are indexed: after a cache
        hit, the hit blocks are).
        """
        raise NotImplementedError("task 2: PrefixBlockManager.__init__")

    # ---- task 2: admission, sharing live blocks ----

    def can_allocate(self, seq: Sequence) -> Admission:
        """Admission(fits, num_cached_blocks); changes nothing.

        num_cached_blocks: how many of seq's leading full blocks are cached, confirmed by their
        tokens and their prefix (not by the key alone), stopping at the first miss and never
        reaching the block that holds seq's last token (that token is always computed).
        fits: the free blocks cover the blocks seq needs beyond its cached ones, plus every
        cached one that is free now (reclaiming a freed block takes it off the free list; a
        block a live sequence holds costs nothing).
        """
        raise NotImplementedError("task 2: PrefixBlockManager.can_allocate")

    def allocate(self, seq: Sequence) -> int:
        """Hold the cached blocks (ref count + 1, or taken back from the free list), then fresh
        blocks for the rest; set seq.block_table, and return how many tokens the cached blocks
        hold (their K/V is stored: the scheduler makes it seq.num_cached_tokens, and the
        prefill skips them). Write nothing else of seq.

        Seed: with A live and hashed, B gets [0, 3, 4, 5], ref_counts[0] == 2, and allocate
        returns 4. A fresh block is about to hold new content: any entry the index
        still has for it is stale, drop it. Hash nothing here: no K/V exists yet.
        """
        raise NotImplementedError("task 2: PrefixBlockManager.allocate")

    # ---- task 3: hashing blocks once their K/V exists ----

    def hash_blocks(self, seq: Sequence) -> None:
        """Index every block of seq that is full of computed K/V and not indexed yet.

        Full of computed K/V: the first seq.num_cached_tokens // block_size blocks. Seed: after
        A's prefill (11 tokens) blocks 0 and 1, not the partial block 2; after A's decode of
        token 99 (num_cached_tokens 12) block 2 too, as [31, 32, 33, 99]. A prefill in chunks
        calls it after every chunk. Key of block i: hash_fn(key of block i - 1, its tokens).

        A key already in the index (two sequences filled the same content in one step): the
        block indexed first stays the one found; record what the other holds anyway, since the
        next block of its sequence names it as its parent.
        """
        raise NotImplementedError("task 3: PrefixBlockManager.hash_blocks")

    # ---- task 4: release, reclaim, and stale entries ----

    def may_append(self, seq: Sequence) -> None:
        """Grow as stage 04 does; a block pulled for new content drops its stale index entry."""
        raise NotImplementedError("task 4: PrefixBlockManager.may_append")

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's reference to each of its blocks, last block first, and free (in that
        order) those no one holds any more; the freed blocks stay findable by their keys.

        Seed: A on [0, 1, 2, 6] with B holding block 0: 6, 2 and 1 are freed, in that order, and
        block 0 stays with B (ref count 2 -> 1). Set seq.block_table = [] (the scheduler sets
        seq.num_cached_tokens = 0: a preempted sequence is recomputed, or found in the cache).
        """
        raise NotImplementedError("task 4: PrefixBlockManager.deallocate")
