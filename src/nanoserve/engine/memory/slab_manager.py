"""Stage 01's cache manager: whole worst-case slabs, one per running sequence.

Introduced in stage 01 (the control-plane half of `cache/contiguous.py`). Admission needs one free
slab; growth never needs more, because a slab already holds max_model_len tokens. No sharing, no
preemption, no tensors.
"""

from __future__ import annotations

from nanoserve.types import Sequence


class SlabManager:
    """Hands out whole slabs: admission needs one free slab, growth never needs more."""

    def __init__(self, num_slabs: int):
        self.num_slabs = num_slabs
        self.free_slab_ids = list(range(num_slabs - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free_slabs(self) -> int:
        """Slabs no sequence owns."""
        return len(self.free_slab_ids)

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Every request fits: a slab holds max_model_len tokens, the engine's own limit."""

    def can_allocate(self, seq: Sequence) -> bool:
        """True when a slab is free."""
        return self.num_free_slabs > 0

    def allocate(self, seq: Sequence) -> int:
        """Give seq a slab (it keeps it until it finishes); nothing in it is seq's yet: 0 tokens
        cached."""
        seq.slab_id = self.free_slab_ids.pop()
        return 0

    def can_append(self, seq: Sequence) -> bool:
        """Always: the slab already has room for max_model_len tokens."""
        return True

    def may_append(self, seq: Sequence) -> None:
        """Nothing to do: growth stays inside the slab."""

    def deallocate(self, seq: Sequence) -> None:
        """Return seq's slab; its K/V bytes stay but nobody reads them."""
        if seq.slab_id is None:
            raise ValueError(f"sequence {seq.seq_id} holds no slab; was it allocated?")
        self.free_slab_ids.append(seq.slab_id)
        seq.slab_id = None

    def check_invariants(self) -> None:
        """Every slab is either free (once) or owned."""
        assert len(set(self.free_slab_ids)) == len(self.free_slab_ids), "a slab is free twice"
        assert all(0 <= s < self.num_slabs for s in self.free_slab_ids), "unknown slab id"
