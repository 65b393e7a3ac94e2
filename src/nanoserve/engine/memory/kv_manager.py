"""The cache-manager seam: the contract every stage's memory bookkeeping meets, and its helpers.

Introduced in stage 01, when a second manager arrived. A manager decides whether a sequence
fits and records where its K/V lives (`seq.slab_id` or `seq.block_table`), and writes nothing
else of a sequence; it owns no tensors.
Stage 01 slabs, stage 03 tables, stage 04 blocks and stage 07 prefix blocks implement it; the
scheduler only asks it. Also here: `Admission` (stage 07's answer to can_allocate), stage 00's
manager (nothing to manage) and the block arithmetic the table and block managers share.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from nanoserve.types import Sequence


class Admission(NamedTuple):
    """can_allocate's answer from stage 07 on: does the sequence fit, and how many leading
    blocks are cached. Truthy exactly when it fits, so `if manager.can_allocate(seq)` reads it
    as the bool of earlier stages."""

    fits: bool
    num_cached_blocks: int

    def __bool__(self) -> bool:
        return self.fits


@runtime_checkable
class KVCacheManager(Protocol):
    """Admission, growth and release of K/V memory, in the scheduler's order of calls.

    Contract, for one sequence's life:
      check_fits(num_prompt_tokens, max_num_tokens)   once, before it is queued: raises ValueError
                                                      for a request that could never finish
      can_allocate(seq) -> allocate(seq) -> int       admission before a prefill; allocate is
                                                      all-or-nothing, sets seq.block_table (or
                                                      seq.slab_id) and returns how many of seq's
                                                      leading tokens already have K/V stored (a
                                                      cached prefix, stage 07; 0 before it)
      can_append(seq)   -> may_append(seq)            before each decode step: room for one token
      deallocate(seq)                                 finish or preemption: releases its memory
    Predicates change nothing. `check_invariants()` raises AssertionError on inconsistent books.
    A manager writes where seq's K/V lives and nothing else of seq: the scheduler keeps
    `num_cached_tokens` (it sets it from allocate's answer, and to 0 in `Scheduler.free`).
    """

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None: ...
    def can_allocate(self, seq: Sequence) -> bool: ...
    def allocate(self, seq: Sequence) -> int: ...
    def can_append(self, seq: Sequence) -> bool: ...
    def may_append(self, seq: Sequence) -> None: ...
    def deallocate(self, seq: Sequence) -> None: ...
    def check_invariants(self) -> None: ...


@runtime_checkable
class PrefixCachingManager(Protocol):
    """A manager that shares full blocks between sequences by content (stage 07).

    Contract: after a forward pass stored K/V for seq's tokens up to `seq.num_cached_tokens`,
    `hash_blocks(seq)` records a hash for every block that is now full and not yet hashed, so a
    later `allocate` can share it. The scheduler calls it in `update`, once per sequence and step.
    """

    def hash_blocks(self, seq: Sequence) -> None: ...


@runtime_checkable
class ReservesRoom(Protocol):
    """A block manager that can hold room past a sequence's tokens and give it back (stage 12:
    guesses take room before the verify step, the rejected ones give it back after)."""

    def reserve(self, seq: Sequence, num_tokens: int) -> int: ...
    def truncate(self, seq: Sequence, num_tokens: int) -> None: ...


@runtime_checkable
class CountsBlocks(Protocol):
    """What `--trace` shows of a block-based manager."""

    num_blocks: int

    @property
    def num_free_blocks(self) -> int: ...


@runtime_checkable
class CountsRefs(Protocol):
    """What `--trace` shows of a manager whose blocks can be shared: holders per block."""

    ref_counts: list[int]


@runtime_checkable
class CountsSlabs(Protocol):
    """What `--trace` shows of a slab-based manager."""

    num_slabs: int

    @property
    def num_free_slabs(self) -> int: ...


class NoCacheManager:
    """Stage 00: memory never limits admission; only `max_num_seqs` bounds the batch."""

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Every request fits: nothing is stored."""

    def can_allocate(self, seq: Sequence) -> bool:
        """Always."""
        return True

    def allocate(self, seq: Sequence) -> int:
        """Nothing to hold, and nothing stored: 0 cached tokens."""
        return 0

    def can_append(self, seq: Sequence) -> bool:
        """Always."""
        return True

    def may_append(self, seq: Sequence) -> None:
        """Nothing to grow."""

    def deallocate(self, seq: Sequence) -> None:
        """Nothing to release; the sequence is recomputed from scratch anyway."""

    def check_invariants(self) -> None:
        """No books to check."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def check_blocks_fit(num_tokens: int, what: str, block_size: int, num_blocks: int) -> None:
    """Raise ValueError when num_tokens (of `what`) need more blocks than the whole pool has.

    Such a request could never finish, even alone: without this check it would wait (or, with
    lazy growth, preempt itself) forever.
    """
    need = blocks_for(num_tokens, block_size)
    if need > num_blocks:
        raise ValueError(
            f"{what} ({num_tokens} tokens) needs {need} blocks of {block_size} but the pool has "
            f"only {num_blocks}; it could never finish. Lower max_tokens or grow the pool "
            "(num_kv_blocks, kv_cache_bytes)"
        )


def grow_table(table, num_tokens: int) -> list[int]:
    """Grow a BlockTable to hold num_tokens tokens; returns the block ids it had to pull. A
    table that holds that many already (stage 12: room reserved for guesses) stays as it is."""
    num_blocks_before = len(table.block_ids)
    table.append(max(0, num_tokens - table.num_tokens))
    return table.block_ids[num_blocks_before:]
