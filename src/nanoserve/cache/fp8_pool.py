"""Stage 13: the e4m3 pool's tensors and the pieces of the format given to its learner.

Introduced in stage 13. `cache/fp8.py` holds what the learner writes (the scale exponent, the
quantize and dequantize, a block's write); this module the pool itself, the constants, exact
powers of two, and `runs`: how one step's slot_mapping splits into runs of tokens that each
write one block (a sequence's new tokens in a block).

    pool.codes      [2, L, num_blocks, block_size, H_kv, D]  uint8   (the e4m3 bits)
    pool.exponents  [2, L, num_blocks, H_kv]                 int32   (scale = 2**exponent)

    slot_mapping [5, 6, 7, 8, -1, 12, 13], block_size 4 -> runs (first, end, block, offset):
      (0, 3, 1, 1)  tokens 0..2 -> block 1, offsets 1..3
      (3, 4, 2, 0)  token 3     -> block 2, offset 0 (a fresh block)
      (5, 7, 3, 0)  tokens 5..6 -> block 3, offsets 0..1   (token 4 is padding)
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # the largest finite e4m3 value, 1.75 * 2**8 (0x7E); 0x7F is NaN
SMALLEST_EXPONENT = -64  # an all-zero (or tiny) block: its scale, 2**-64, still a normal float


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as float32, exactly (built from the bits), for exponents in [-126, 127]."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def runs(slot_mapping: torch.Tensor, block_size: int) -> list[tuple[int, int, int, int]]:
    """(first token, end token, block, offset) of each run of tokens that write one block:
    consecutive slots of one block (a sequence's new tokens); slot -1 (padding) is skipped."""
    found: list[tuple[int, int, int, int]] = []
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        first, end, last_block, first_offset = found[-1] if found else (0, -1, -1, 0)
        if end == t and last_block == block and first_offset + t - first == offset:
            found[-1] = (first, t + 1, block, first_offset)  # the run goes on
        else:
            found.append((t, t + 1, block, offset))
    return found


def kv_bytes_per_token_fp8(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int):
    """One token's K and V codes across the layers, plus its share of the blocks' exponents."""
    codes = 2 * num_layers * num_kv_heads * head_dim
    exponents = 2 * num_layers * num_kv_heads * 4  # one int32 per (K/V, layer, block, head)
    return codes + -(-exponents // block_size)


class Fp8KVPool:
    """The stage 04 pool's layout in e4m3 codes, with each block's per-head exponents."""

    def __init__(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device):
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.codes = torch.zeros(shape, dtype=torch.uint8, device=device)
        self.exponents = torch.full(
            (2, num_layers, num_blocks, num_kv_heads), SMALLEST_EXPONENT, dtype=torch.int32,
            device=device,
        )  # fmt: skip
        self.kv = self.codes  # the name the other pools give their tensor
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype  # what attention computes in: the model's dtype
        self.device = device

    def layer_caches(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V codes, each (num_blocks, block_size, H_kv, D) uint8."""
        return self.codes[0, layer_id], self.codes[1, layer_id]

    def layer_scales(self, layer_id: int) -> dict[str, torch.Tensor]:
        """This layer's K and V exponents, each (num_blocks, H_kv) int32, as the kernels take
        them (`k_scales=`, `v_scales=`)."""
        return {"k_scales": self.exponents[0, layer_id], "v_scales": self.exponents[1, layer_id]}
