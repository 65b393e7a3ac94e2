"""Stage 03's engine: sequences live on block tables, and K/V sits at their flat slots.

Introduced in stage 03. Each running sequence owns a `BlockTable` over one shared
`BlockAllocator`; every token's K/V is written to `slot(p)` of a flat per-layer tensor and read
back by translating positions 0 .. n-1, one by one. Admission still reserves the worst case
(prompt + max_tokens, in blocks rather than stage 01's max_model_len slabs), so decode never
runs out; lazy growth with preemption, and block-table reads, arrive in stage 04.

    flat cache [2, L, num_blocks * block_size, H_kv, D]      block_size 4, A's table [1, 0, 2]
    slot:  0  1  2  3 | 4  5  6  7 | 8  9 10 11 | ...
          A4 A5 A6 A7 | A0 A1 A2 A3 | A8 A9 .  . |          A reads slots 4..7, 0..3, 8..9
"""

from __future__ import annotations

import math

import torch

from nanoserve.cache.allocator import BlockAllocator
from nanoserve.cache.block_table import BlockTable
from nanoserve.engine.forward_inputs import ForwardInputs, pack_tokens, to_forward_inputs
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence
from nanoserve.kernels.attention import attend
from nanoserve.sampling import SamplingParams


class TableManager:
    """One BlockTable per running sequence, plus the blocks promised to it but not yet pulled."""

    def __init__(self, allocator, block_size: int, max_model_len: int, table_cls=BlockTable):
        self.allocator = allocator
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.table_cls = table_cls
        self.tables: dict[int, BlockTable] = {}  # seq_id -> table
        self.num_promised: dict[int, int] = {}  # seq_id -> blocks reserved, not yet pulled

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds (some of them may be promised)."""
        return self.allocator.num_free_blocks

    def blocks_needed(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Blocks for the longest this request can get: prompt + max_tokens, capped."""
        longest = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        return math.ceil(longest / self.block_size)

    def check_fits(self, num_prompt_tokens: int, max_num_tokens: int) -> None:
        """Raise ValueError for a request that could not fit even in an empty pool."""
        need = math.ceil(max_num_tokens / self.block_size)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"request needs {need} blocks of {self.block_size} tokens (prompt + max_tokens) "
                f"but the pool has {self.allocator.num_blocks}; lower max_tokens or grow the pool"
            )

    def can_allocate(self, seq: Sequence) -> bool:
        """True when the unpromised free blocks cover seq's worst case."""
        unpromised = self.allocator.num_free_blocks - sum(self.num_promised.values())
        return unpromised >= self.blocks_needed(seq.num_prompt_tokens, seq.params)

    def allocate(self, seq: Sequence) -> None:
        """Pull blocks for the prompt now; promise the rest of the worst case."""
        table = self.table_cls(self.allocator, self.block_size)
        table.append(len(seq))
        self.tables[seq.seq_id] = table
        seq.block_table = table.block_ids  # the same list, so --trace can show it
        need = self.blocks_needed(seq.num_prompt_tokens, seq.params)
        self.num_promised[seq.seq_id] = need - len(table.block_ids)

    def can_append(self, seq: Sequence) -> bool:
        """Always: the blocks for decode were promised at admission."""
        return True

    def may_append(self, seq: Sequence) -> None:
        """Grow seq's table by the token this decode step writes (a block only at a boundary)."""
        table = self.tables[seq.seq_id]
        num_blocks_before = len(table.block_ids)
        table.append(len(seq) - table.num_tokens)
        self.num_promised[seq.seq_id] -= len(table.block_ids) - num_blocks_before

    def deallocate(self, seq: Sequence) -> None:
        """Hand every block and promise back."""
        self.tables.pop(seq.seq_id).free()
        del self.num_promised[seq.seq_id]
        seq.block_table, seq.num_cached_tokens = [], 0

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat slots of positions start .. end-1 of seq, translated through its table."""
        table = self.tables[seq.seq_id]
        return [table.slot(p) for p in range(start, end)]


class SlotKVCache:
    """Flat per-layer K/V addressed by slot, and the inputs for each sequence's new tokens."""

    def __init__(self, manager: TableManager, num_blocks, num_layers, num_kv_heads, head_dim,
                 dtype, device):  # fmt: skip
        num_slots = num_blocks * manager.block_size
        shape = (2, num_layers, num_slots, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.manager = manager
        self.device = device

    def prepare(self, batch: ScheduledBatch) -> ForwardInputs:
        """New tokens of each sequence, the slots they are written to, the slots to read."""
        packed = pack_tokens(batch.seqs)
        write_slots, read_slots = [], []
        for seq in batch.seqs:
            write_slots.extend(self.manager.slots(seq, seq.num_cached_tokens, len(seq)))
            read_slots.append(
                torch.tensor(self.manager.slots(seq, 0, len(seq)), device=self.device)
            )
        slot_mapping = torch.tensor(write_slots, device=self.device)
        attn = SlotAttention(self.kv, slot_mapping, read_slots, packed.cu_seqlens_q)
        return to_forward_inputs(packed, attn, self.device)


class SlotAttention:
    """Write every new token's K/V to its slot, then gather each sequence's slots and attend."""

    def __init__(self, kv: torch.Tensor, slot_mapping, read_slots, cu_seqlens_q: list[int]):
        self.kv = kv
        self.slot_mapping = slot_mapping  # (T,) one slot per packed new token
        self.read_slots = read_slots  # per sequence: (n,) slots of positions 0 .. n-1
        self.cu_seqlens_q_list = cu_seqlens_q

    def forward(self, layer_id: int, q, k, v, scale: float) -> torch.Tensor:
        """(T, H, D) outputs for the packed new tokens of every sequence."""
        k_cache, v_cache = self.kv[0, layer_id], self.kv[1, layer_id]  # (num_slots, H_kv, D)
        k_cache[self.slot_mapping] = k
        v_cache[self.slot_mapping] = v
        outputs = []
        for i, slots in enumerate(self.read_slots):
            s, e = self.cu_seqlens_q_list[i], self.cu_seqlens_q_list[i + 1]
            outputs.append(attend(q[s:e], k_cache[slots], v_cache[slots], scale))
        return torch.cat(outputs)


def build_table_manager(config, num_blocks: int, components: dict) -> TableManager:
    """The stage-03 manager over a (possibly learner-provided) allocator and block table."""
    allocator = components.get("BlockAllocator", BlockAllocator)(num_blocks)
    table_cls = components.get("BlockTable", BlockTable)
    return TableManager(allocator, config.block_size, config.max_model_len, table_cls)
