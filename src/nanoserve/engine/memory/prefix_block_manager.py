"""Stage 07's block manager: full blocks are hashed by content and shared between sequences.

Introduced in stage 07, beside stage 04's `BlockManager` (which it extends). A full block's key is
a chained hash of its tokens and of every block before it, so a block is found only behind the
same prefix. A hit is confirmed by the block's own tokens and by its parent link, never by the
hash alone. Freed blocks stay findable until they are handed out for other content. It owns no
tensors: sharing a block means two block tables hold the same id.

    A = [11 12 13 14 | 21 22 23 24 | 31 32 33]     table [0, 1, 2]    hashed: 0, 1
    B = [11 12 13 14 | 51 52 53 54 | 61 62 63 64 | 71]
         '- h0 -> block 0 (A's; ref 2)            table [0, 3, 4, 5]  allocate returns 4
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import NamedTuple

from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.memory.block_table import BlockTable
from nanoserve.engine.memory.kv_manager import Admission, blocks_for
from nanoserve.types import Sequence


def chain_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """blake2b(parent hash || token ids as 8-byte integers): a block's key behind its prefix."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids))
    return digest.digest()


class CachedBlock(NamedTuple):
    """What a hashed block holds: enough to confirm a hit without trusting the hash."""

    key: bytes  # chain_hash(parent's key, token_ids)
    token_ids: tuple[int, ...]
    parent: tuple[int, int] | None  # (block id, version) of the block before it; None at the start
    version: int  # changes whenever the block is hashed anew, so stale children cannot match


class Remembered(NamedTuple):
    """The prefix can_allocate found for one sequence, so allocate need not hash it again."""

    key: tuple[int, int]  # (seq_id, len(seq)) when it was found
    hits: list[tuple[int, CachedBlock]]  # (block id, the entry it held) per hit, in order

    def answers(self, seq: Sequence, cached: dict[int, CachedBlock]) -> bool:
        """True for the same sequence at the same length while every hit block still holds the
        very entry it held (none was rehashed or handed out for other content since)."""
        same_seq = self.key == (seq.seq_id, len(seq))
        return same_seq and all(cached.get(block_id) is entry for block_id, entry in self.hits)


class PrefixBlockManager(BlockManager):
    """BlockManager plus a content index of full blocks: share live ones, reclaim freed ones."""

    def __init__(self, num_blocks: int, block_size: int, hash_fn: Callable = chain_hash, **kw):
        super().__init__(num_blocks, block_size, **kw)
        self.hash_fn = hash_fn  # tests inject a weak hash: hits must still be confirmed
        self.hash_to_block_id: dict[bytes, int] = {}
        self.cached: dict[int, CachedBlock] = {}  # block id -> what it holds, while findable
        self.num_hashed: dict[int, int] = {}  # seq_id -> leading blocks of its table hashed
        self.num_versions = 0
        self.num_prompt_tokens = 0  # for the hit rate: every admitted prompt token ...
        self.num_hit_tokens = 0  # ... and those found cached
        self.remembered: Remembered | None = None  # the last admission's hits (hash once)

    @property
    def hit_rate(self) -> float:
        """Cached tokens / prompt tokens over every admission so far (0 before any)."""
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding seq's leading full blocks, confirmed; at least one token is left."""
        block_ids: list[int] = []
        parent: tuple[int, int] | None = None
        parent_key = b""
        max_blocks = (len(seq) - 1) // self.block_size  # a fully cached prompt computes its last
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            key = self.hash_fn(parent_key, tokens)
            block_id = self.hash_to_block_id.get(key, -1)  # -1: no block has this key
            entry = self.cached.get(block_id)
            if entry is None or entry.token_ids != tokens or entry.parent != parent:
                break  # no entry, a collision, or a block whose prefix was repurposed
            block_ids.append(block_id)
            parent, parent_key = (block_id, entry.version), key
        return block_ids

    def can_allocate(self, seq: Sequence) -> Admission:  # type: ignore[override]  # a richer bool
        """Fits when the free blocks cover the uncached blocks plus the freed hits reclaimed."""
        return self._admission(seq, self._hits(seq))

    def allocate(self, seq: Sequence) -> int:
        """Share or reclaim the cached prefix, pull fresh blocks for the rest (all-or-nothing);
        returns the cached prefix's tokens (their K/V is stored: the prefill skips them)."""
        hits = self._hits(seq)  # what can_allocate just found: the prompt is hashed once
        if not self._admission(seq, hits):
            raise ValueError(f"sequence {seq.seq_id} does not fit; ask can_allocate first")
        for block_id in hits:
            if self.ref_counts[block_id] == 0:  # freed but still holding this prefix
                self.allocator.take(block_id)
        table = self.table_cls(self.allocator, self.block_size)
        table.adopt(hits)
        self._hold(hits)
        self._grow(seq, table)
        self.num_hashed[seq.seq_id] = len(hits)
        num_cached_tokens = len(hits) * self.block_size
        self.num_prompt_tokens += len(seq)
        self.num_hit_tokens += num_cached_tokens
        return num_cached_tokens

    def _hits(self, seq: Sequence) -> list[int]:
        """cached_prefix(seq), remembered between can_allocate and allocate of the same seq."""
        memo = self.remembered
        if memo is not None and memo.answers(seq, self.cached):
            return [block_id for block_id, _ in memo.hits]
        hits = self.cached_prefix(seq)
        self.remembered = Remembered((seq.seq_id, len(seq)), [(b, self.cached[b]) for b in hits])
        return hits

    def _admission(self, seq: Sequence, hits: list[int]) -> Admission:
        reclaimed = sum(1 for b in hits if self.ref_counts[b] == 0)  # they come off the free list
        need = blocks_for(len(seq), self.block_size) - len(hits) + reclaimed
        return Admission(self.num_free_blocks >= need, len(hits))

    def _grow(self, seq: Sequence, table: BlockTable, num_tokens: int | None = None) -> list[int]:
        """Grow as stage 04 does; a block pulled for new content drops its stale entry."""
        fresh = super()._grow(seq, table, num_tokens)
        for block_id in fresh:
            self._forget(block_id)
        return fresh

    def hash_blocks(self, seq: Sequence) -> None:
        """Index every block of seq that is full of computed K/V and not yet hashed."""
        table, bs = self.tables[seq.seq_id], self.block_size
        start, end = self.num_hashed[seq.seq_id], seq.num_cached_tokens // bs
        parent = None
        if start > 0:
            prev_id = table.block_ids[start - 1]
            parent = (prev_id, self.cached[prev_id].version)
        for i in range(start, end):
            block_id = table.block_ids[i]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent_key = self.cached[parent[0]].key if parent else b""
            self.num_versions += 1
            entry = CachedBlock(self.hash_fn(parent_key, tokens), tokens, parent, self.num_versions)
            self.cached[block_id] = entry
            self.hash_to_block_id.setdefault(entry.key, block_id)  # first holder stays findable
            parent = (block_id, entry.version)
        self.num_hashed[seq.seq_id] = max(start, end)

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's hold, last block first; freed blocks stay findable by their hash."""
        del self.num_hashed[seq.seq_id]
        block_ids = self._release(seq)
        self.allocator.free([b for b in reversed(block_ids) if self.ref_counts[b] == 0])

    def _forget(self, block_id: int) -> None:
        """Remove a block's content entry (it is about to hold something else)."""
        entry = self.cached.pop(block_id, None)
        if entry is not None and self.hash_to_block_id.get(entry.key) == block_id:
            del self.hash_to_block_id[entry.key]

    def check_invariants(self) -> None:
        """Stage 04's books, plus: every index entry points at a block that holds that key."""
        super().check_invariants()
        for key, block_id in self.hash_to_block_id.items():
            assert self.cached[block_id].key == key, f"stale index entry for block {block_id}"
        for seq_id, table in self.tables.items():
            assert self.num_hashed[seq_id] <= len(table.block_ids), seq_id
