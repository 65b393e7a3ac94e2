"""Stage 01 starter: a contiguous KV cache, one worst-case slab per running sequence.

Fill in each body (the lesson, stages/01_contiguous_cache/README.md, walks through them in task
order) in a copy: `cp stages/01_contiguous_cache/starter.py my_cache.py`, then grade it with
`pytest stages/01_contiguous_cache --impl my_cache.py`. This file itself must keep failing (the
harness checks it). `SlabManager` is bookkeeping on integers (no tensors); `store_slab` and
`load_slab` are the only code that touches the cache tensor.
"""

from __future__ import annotations

import torch

# ---- tasks 1-2: the slab manager (the engine's cache manager for this stage) ----


class SlabManager:
    """Hands out whole slabs, ids 0 .. num_slabs-1: one per running sequence, for its whole life.

    The scheduler calls it like this (a `seq` is `nanoserve.types.Sequence`; the only
    attribute of it you write is `slab_id`: where its K/V lives):

        check_fits(num_prompt_tokens, max_num_tokens)  once per request, before it is queued
        can_allocate(seq) -> allocate(seq) -> int       admission: a waiting seq gets a slab;
                                                        allocate answers how many of its tokens
                                                        already have K/V stored
        can_append(seq)   -> may_append(seq)            before every decode step of a seq
        deallocate(seq)                                 when seq finishes (or is preempted)

    The scheduler keeps `seq.num_cached_tokens` itself: it sets it to allocate's answer at
    admission and to 0 when it deallocates. One writer per field: a manager that wrote it too
    would be a second place to get it wrong.

    A slab has room for max_model_len tokens, the longest any sequence may get, so once a
    sequence holds a slab it never needs more memory.
    """

    def __init__(self, num_slabs: int) -> None:
        """All `num_slabs` slabs free. Keep `num_slabs` as a public attribute.

        Hint: a list of free slab ids used as a stack, filled so that the first pop() gives 0
        (a fresh manager must hand out 0, 1, 2, ... in that order).
        """
        raise NotImplementedError("task 1: SlabManager.__init__")

    @property
    def num_free_slabs(self) -> int:
        """Slabs no sequence holds right now."""
        raise NotImplementedError("task 1: SlabManager.num_free_slabs")

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Raise ValueError for a request that could never run; return None when it can.

        max_num_tokens is the longest the request can get (prompt + max_tokens, already capped
        at max_model_len by the engine). A slab holds max_model_len tokens, so: can any request
        fail to fit?
        """
        raise NotImplementedError("task 1: SlabManager.check_fits")

    def can_allocate(self, seq) -> bool:
        """True when `allocate(seq)` would succeed now: some slab is free."""
        raise NotImplementedError("task 1: SlabManager.can_allocate")

    def allocate(self, seq) -> int:
        """Give seq a free slab: set `seq.slab_id` to its id. Only called after can_allocate.

        Returns how many of seq's tokens already have K/V stored in it. A slab just handed out
        holds nothing of seq's (a previous owner's bytes are not seq's), so: 0.
        """
        raise NotImplementedError("task 1: SlabManager.allocate")

    def can_append(self, seq) -> bool:
        """True when seq's next decode token has room. Does a slab ever run out?"""
        raise NotImplementedError("task 2: SlabManager.can_append")

    def may_append(self, seq) -> None:
        """Make room for the token this decode step writes. What is there to do?"""
        raise NotImplementedError("task 2: SlabManager.may_append")

    def deallocate(self, seq) -> None:
        """Take seq's slab back; then `seq.slab_id = None`.

        The slab's bytes stay as they are: the next owner overwrites each position before it
        reads it. (The scheduler sets seq.num_cached_tokens to 0 itself: nothing of seq is
        stored any more, so if seq ever runs again it is prefilled from its first token.)
        """
        raise NotImplementedError("task 2: SlabManager.deallocate")


# ---- task 3: writing and reading a slab ----


def store_slab(cache: torch.Tensor, slab_id: int, start: int, values: torch.Tensor) -> None:
    """Write values (n, H_kv, D) into positions start .. start+n-1 of slab `slab_id`, in place.

    cache (num_slabs, max_model_len, H_kv, D): one layer's keys, or its values. It is a view into
    the engine's whole [2, L, num_slabs, max_model_len, H_kv, D] tensor, so write *into* it
    (an indexed assignment); building a new tensor would leave the engine's cache unchanged.
    Touch no other position and no other slab. Prefill calls it with start 0 and the whole
    prompt; each decode step with start = len(seq) - 1 (= num_cached_tokens: the positions
    already stored) and n = 1.
    """
    raise NotImplementedError("task 3: store_slab")


def load_slab(cache: torch.Tensor, slab_id: int, end: int) -> torch.Tensor:
    """Positions 0 .. end-1 of slab `slab_id`, in order: (end, H_kv, D).

    cache (num_slabs, max_model_len, H_kv, D) as in store_slab. The engine passes the keys (and
    then the values) you return straight to attention, as the history of end tokens. Returning a
    view (a slice) is fine: the caller does not modify it.
    """
    raise NotImplementedError("task 3: load_slab")
