"""Stage 04 starter: one paged KV pool, the block manager that hands out its pages, and the
per-step tensors that tell attention where to write and where to read.

Fill in each body (the lesson, stages/04_paged_pool/README.md, walks through them in task
order) in a copy: `cp stages/04_paged_pool/starter.py my_pool.py`, then grade it with
`pytest stages/04_paged_pool --impl my_pool.py`; this file itself must keep failing. Task 6
plugs all five names into the reference engine and demands stage 01's tokens, with a pool large
enough for everything and with one so small it must preempt.

    the pool, allocated once:  [2, L, N, block_size, H_kv, D]
                                |  |  |      |
            K=0 / V=1 ----------'  |  |      '-- offset inside the block
            layer ----------------'  '-- physical block id (what a block table holds)

    one layer's k_cache = pool[0, layer]: N blocks of block_size rows, each row (H_kv, D)

        block 0          block 1          block 2          block 3        block_size 4
      +--+--+--+--+    +--+--+--+--+    +--+--+--+--+    +--+--+--+--+
      | 0| 1| 2| 3|    | 4| 5| 6| 7|    | 8| 9|10|11|    |12|13|14|15|   <- flat slots
      +--+--+--+--+    +--+--+--+--+    +--+--+--+--+    +--+--+--+--+

    flat slot s  =  block_id * block_size + offset   <->   block s // block_size, row s % block_size
"""

from __future__ import annotations

import torch

from nanoserve.engine.memory.allocator import BlockAllocator  # noqa: F401  (stage 02; use it in task 1)
from nanoserve.engine.memory.block_table import BlockTable  # noqa: F401  (stage 03; use it in task 1)
from nanoserve.engine.runner.step_tensors import step_inputs_from_lists  # noqa: F401  (tasks 4, 5)
from nanoserve.types import Sequence, StepInputs

# StepInputs (with its AttentionMetadata, in nanoserve/types.py) is what the engine reads: the
# types are given, and your prepare_* functions compute the values as plain lists;
# `step_inputs_from_lists` (given) turns them into tensors of the right dtypes, pads the block
# tables with -1 and fills in max_seqlen_q/k and the host copies.
#
# BlockAllocator and BlockTable above are the references of stages 02 and 03. To build your block
# manager on your own files instead, load them by path or by module name, the same values --impl
# takes; base=__file__ finds the paths next to this file, wherever pytest or `nanoserve check`
# runs from:
#   from nanoserve import grading
#   BlockAllocator = grading.load_impl(2, "my_allocator.py", base=__file__).BlockAllocator
#   BlockTable = grading.load_impl(3, "my_block_table.py", base=__file__).BlockTable

# ---- task 1: the block manager ----


class BlockManager:
    """Which physical blocks each running sequence holds. Bookkeeping only: no tensors.

    The scheduler calls, in this order for one sequence's life:
      can_allocate(seq) -> allocate(seq)                      admission, before its prefill
      can_append(seq)   -> may_append(seq)                    before each of its decode steps
      deallocate(seq)                                         when it finishes or is preempted
    and the engine calls check_fits(...) once per request, before queueing it.

    After allocate and after may_append, `seq.block_table` (a list of block ids in logical order)
    must hold exactly ceil(len(seq) / block_size) blocks: one per started page, none ahead of need.
    No two live sequences hold the same block (sharing arrives with stage 07's prefix cache).

    Hint: keep one stage-03 BlockTable per sequence (keyed by seq.seq_id) over one shared
    stage-02 BlockAllocator; the table already grows lazily and frees in order. A fresh pool must
    hand out ids 0, 1, 2, ... (the stage-02 allocator does).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """A pool of num_blocks free blocks of block_size tokens; keep both as public attributes."""
        raise NotImplementedError("task 1: BlockManager.__init__")

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live sequence holds."""
        raise NotImplementedError("task 1: BlockManager.num_free_blocks")

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Raise ValueError if the request could not finish even alone in an empty pool.

        max_num_tokens is the longest the sequence can become (prompt + max_tokens, capped at
        max_model_len). A request needing more than num_blocks blocks would preempt itself
        forever, so it is refused before it is queued. Say how many blocks it needs.
        """
        raise NotImplementedError("task 1: BlockManager.check_fits")

    def can_allocate(self, seq: Sequence) -> bool:
        """True when enough blocks are free for every token seq has now.

        Count len(seq), not the prompt: a preempted sequence comes back with its generated tokens
        too, and all of them are recomputed. Changes nothing.
        """
        raise NotImplementedError("task 1: BlockManager.can_allocate")

    def allocate(self, seq: Sequence) -> int:
        """Give seq ceil(len(seq) / block_size) blocks and set seq.block_table to them, in order.

        Returns how many of seq's tokens already have K/V in those blocks: fresh blocks hold
        none of seq's, so 0 (stage 07's manager answers more: a cached prefix). The scheduler
        sets seq.num_cached_tokens from it; a manager writes seq.block_table and nothing else.
        """
        raise NotImplementedError("task 1: BlockManager.allocate")

    def can_append(self, seq: Sequence) -> bool:
        """True when seq's next decode token has somewhere to go.

        At decode time seq already holds the token the step will feed (sampled last step, K/V not
        stored yet), at position len(seq) - 1. It needs a new block exactly when that position is
        past the blocks held: len(seq.block_table) * block_size < len(seq). (The seed writes this
        as len(seq) % block_size == 1; check why that breaks for block_size 1.) Changes nothing.
        """
        raise NotImplementedError("task 1: BlockManager.can_append")

    def may_append(self, seq: Sequence) -> None:
        """Grow seq's table to cover len(seq) tokens: one new block at a boundary, else nothing.
        seq.block_table follows (the new id appended): the runner reads slots from it.

        Blocks already in seq.block_table never move: their K/V is in the pool.
        """
        raise NotImplementedError("task 1: BlockManager.may_append")

    def deallocate(self, seq: Sequence) -> None:
        """Return every block of seq to the pool in table order (so its last block is the first
        handed out again, as stage 03's free() does); set seq.block_table = []. (The scheduler
        sets seq.num_cached_tokens = 0: its K/V is gone, a preempted sequence is recomputed.)"""
        raise NotImplementedError("task 1: BlockManager.deallocate")

    def check_invariants(self) -> None:
        """Raise AssertionError if the books disagree; the tests call it after every step.

        For example: free + held == num_blocks; no block held twice; every live sequence holds
        enough blocks for its tokens. It is your debugging aid: make it strict. Graded: after
        allocate(seq) twice for one seq (a scheduler bug; your allocate may also refuse it), the
        first blocks are neither free nor held, and this must raise.
        """
        raise NotImplementedError("task 1: BlockManager.check_invariants")


# ---- task 2: write K/V into the pool by slot ----


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's new keys and values into one layer's caches, in place.

    k, v (T, H_kv, D): one row per new token, packed across the batch.
    k_cache, v_cache (N, block_size, H_kv, D): views into the pool; write INTO them (the engine
        keeps the pool, not what you return). Return nothing.
    slot_mapping (T,) int64: token j goes to flat slot slot_mapping[j], i.e. block
        slot // block_size, row slot % block_size. A slot of -1 marks a padding row that owns
        no slot: skip it (indexing with -1 would silently hit the pool's very last slot).

    Hint: on a contiguous (N, block_size, H_kv, D) tensor, `.view(N * block_size, H_kv, D)` is
    the same memory seen as one row per slot, so a single indexed assignment does the scatter.
    """
    raise NotImplementedError("task 2: store_kvcache")


# ---- task 3: read one sequence's history through its block table ----


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first context_len positions of K (or V), in logical order.

    cache (N, block_size, H_kv, D): one layer's k_cache or v_cache.
    block_table (max_blocks,) int: the sequence's row of the batch's block_tables; entry i is the
        physical block holding positions i * block_size .. (i + 1) * block_size - 1. Entries past
        the ones this context needs may be -1 (padding): never read them.
    Returns (context_len, H_kv, D): row p is position p, wherever its block sits in the pool.

        block_table [5, 2, -1], block_size 4, context_len 6
        cache[5] -> positions 0..3     cache[2] -> positions 4, 5 (rows 2, 3 not written yet)

    Hint: the first ceil(context_len / block_size) entries are the blocks to read; indexing the
    cache with them gives (num_blocks, block_size, H_kv, D); flatten two dims, keep context_len.
    """
    raise NotImplementedError("task 3: gather_kv")


# ---- task 4: the prefill step's tensors ----


def prepare_prefill(seqs: list[Sequence], block_size: int, device) -> StepInputs:
    """Pack every uncached token of each sequence into one step.

    For each seq, the new tokens are positions start = seq.num_cached_tokens .. len(seq) - 1
    (start is 0 in this stage; stage 07's prefix cache makes it a multiple of block_size).
      input_ids, positions (T,): those tokens and their positions, sequence after sequence.
      slot_mapping (T,): block_table[p // block_size] * block_size + p % block_size for each p.
      cu_seqlens_q (B + 1,): 0, then running sums of the new-token counts (len(seq) - start).
      cu_seqlens_k (B + 1,): 0, then running sums of len(seq): attention also sees the prefix.
      context_lens (B,): len(seq).
      block_tables (B, max_blocks): each seq.block_table padded with -1 to the longest.
    Seed trace, block_size 4: prompt A of 11 tokens with block_table [0, 1, 2] gives
    slot_mapping 0..10 and cu_seqlens_q = cu_seqlens_k = [0, 11].

    Read seq.block_table; change nothing. Return `step_inputs_from_lists(True, input_ids,
    positions, slot_mapping, cu_seqlens_q, cu_seqlens_k, context_lens, block_tables, device)`
    with block_tables the list of each seq.block_table (it pads them with -1).
    """
    raise NotImplementedError("task 4: prepare_prefill")


# ---- task 5: the decode step's tensors ----


def prepare_decode(seqs: list[Sequence], block_size: int, device) -> StepInputs:
    """One token per sequence: its last, which has no K/V yet.

      input_ids (B,): seq.last_token_id.    positions (B,): len(seq) - 1.
      slot_mapping (B,): the slot of position len(seq) - 1 (where this step writes).
      context_lens (B,): len(seq) (what it attends over, the new token included).
      cu_seqlens_q: [0, 1, 2, ..., B].      cu_seqlens_k: 0, then running sums of len(seq).
      block_tables (B, max_blocks): each seq.block_table padded with -1 (where it reads).
    Seed trace, block_size 4: A of 12 tokens on [0, 1, 2] writes slot 2 * 4 + 3 = 11; at 13
    tokens on [0, 1, 2, 6] it writes slot 6 * 4 + 0 = 24.
    """
    raise NotImplementedError("task 5: prepare_decode")
