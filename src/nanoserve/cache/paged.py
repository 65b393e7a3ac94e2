"""Stage 04: one paged KV pool, written by `slot_mapping` and read through `block_tables`.

Introduced in stage 04. The pool is allocated once; each layer attends through its own view.
This module holds the tensor only: `kernels/torch_paged.py` scatters each new token's K/V to its
flat slot and gathers a sequence's blocks in table order (stage 05 writes with Triton, stage 06
reads without gathering).

    pool  [2, L, num_blocks, block_size, H_kv, D]        layer i: k_cache = pool[0, i]
                                                                  v_cache = pool[1, i]
    flat slot s of a layer  =  block s // block_size, offset s % block_size

    block_tables (padded with -1)       context_lens      read for sequence 0:
      [[0, 1, 2, 6],                     [13,              blocks 0, 1, 2, 6 -> 16 rows,
       [5, 3, 4, -1]]                     10]              keep the first 13
"""

from __future__ import annotations

import torch


class PagedKVPool:
    """The pool tensor, allocated once; each layer reads and writes its own two views."""

    def __init__(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device):
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = device

    def layer_caches(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V views, each (num_blocks, block_size, H_kv, D)."""
        return self.kv[0, layer_id], self.kv[1, layer_id]

    def layer_scales(self, layer_id: int) -> dict[str, torch.Tensor]:
        """No scales: the values are stored as they are (stage 13's e4m3 pool has some)."""
        return {}
