"""Stage 02's engine is stage 01's: the allocator is graded on its own, and stage 03's engine is
where it is plugged in (as `BlockAllocator`)."""

from __future__ import annotations

import dataclasses

from nanoserve.recipes import contiguous_cache

RECIPE = dataclasses.replace(
    contiguous_cache.RECIPE,
    api={
        "OutOfBlocks": "nanoserve.engine.memory.allocator:OutOfBlocks",
        "BlockAllocator": "nanoserve.engine.memory.allocator:BlockAllocator",
    },
)
