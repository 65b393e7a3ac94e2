"""Stage 04's tensors checked against the seed's hand traces (block_size 4)."""

import torch

from nanoserve.engine.memory.block_manager import BlockManager
from nanoserve.engine.runner.input_packer import prepare_decode, prepare_prefill
from nanoserve.kernels.torch_paged import gather_kv, store_kvcache
from nanoserve.sampling import SamplingParams
from nanoserve.types import Sequence

A = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33]


def admitted(manager: BlockManager, token_ids: list[int]) -> Sequence:
    seq = Sequence(token_ids, SamplingParams())
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    return seq


def test_prefill_of_an_11_token_prompt_writes_slots_0_to_10():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = admitted(manager, A)
    assert a.block_table == [0, 1, 2]
    step = prepare_prefill([a], block_size=4, device="cpu")
    assert step.input_ids.tolist() == A
    assert step.positions.tolist() == list(range(11))
    assert step.metadata.slot_mapping.tolist() == list(range(11))
    assert step.metadata.cu_seqlens_q.tolist() == [0, 11]
    assert step.metadata.cu_seqlens_k.tolist() == [0, 11]


def test_decode_at_length_12_writes_slot_11_without_a_new_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = admitted(manager, A)
    a.num_cached_tokens = 11
    a.append_token(99)  # the first completion token, K/V not computed yet
    assert manager.can_append(a)
    manager.may_append(a)
    assert a.block_table == [0, 1, 2]
    step = prepare_decode([a], block_size=4, device="cpu")
    assert step.input_ids.tolist() == [99]
    assert step.positions.tolist() == [11]
    assert step.metadata.context_lens.tolist() == [12]
    assert step.metadata.slot_mapping.tolist() == [11]
    assert step.metadata.block_tables.tolist() == [[0, 1, 2]]


def test_decode_at_length_13_pulls_a_new_block_and_writes_its_first_slot():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = admitted(manager, A)
    b = admitted(manager, [1, 2, 3])  # takes block 3, so A's next block is 4
    a.num_cached_tokens = 12
    a.token_ids += [99, 100]
    manager.may_append(a)
    assert a.block_table == [0, 1, 2, 4]
    step = prepare_decode([a, b], block_size=4, device="cpu")
    assert step.metadata.slot_mapping.tolist()[0] == 4 * 4 + 0
    assert step.metadata.block_tables.tolist() == [[0, 1, 2, 4], [3, -1, -1, -1]]
    manager.check_invariants()


def test_packed_prefill_of_two_sequences_counts_the_cached_prefix_in_cu_seqlens_k():
    manager = BlockManager(num_blocks=8, block_size=4)
    c = admitted(manager, [40, 41, 42, 43, 44, 45, 46])
    d = admitted(manager, [50, 51])
    c.num_cached_tokens = 4  # as if a prefix of 4 tokens were already stored
    step = prepare_prefill([c, d], block_size=4, device="cpu")
    assert step.input_ids.tolist() == [44, 45, 46, 50, 51]
    assert step.positions.tolist() == [4, 5, 6, 0, 1]
    assert step.metadata.cu_seqlens_q.tolist() == [0, 3, 5]
    assert step.metadata.cu_seqlens_k.tolist() == [0, 7, 9]


def test_store_skips_padding_slots_and_gather_reads_back_in_logical_order():
    k_cache = torch.zeros(6, 4, 1, 2)  # 6 blocks of 4 slots, 1 kv head, head_dim 2
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([5, 2, 0])  # scattered on purpose
    positions = torch.arange(10)
    slots = table[positions // 4] * 4 + positions % 4
    k = torch.arange(20.0).view(10, 1, 2)
    store_kvcache(k, -k, k_cache, v_cache, slots)
    padded = torch.cat([slots, torch.tensor([-1])])
    store_kvcache(torch.cat([k, k[:1] + 100]), torch.cat([-k, k[:1]]), k_cache, v_cache, padded)
    assert torch.equal(gather_kv(k_cache, table, 10), k)
    assert torch.equal(gather_kv(v_cache, table, 10), -k)
    assert (k_cache[1] == 0).all() and (k_cache[3] == 0).all()  # untouched blocks


def test_seq_b_lands_on_blocks_freed_by_a_in_lifo_order():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = admitted(manager, list(range(8)))
    assert a.block_table == [0, 1]
    manager.deallocate(a)
    b = admitted(manager, list(range(12)))
    assert b.block_table == [1, 0, 2]
    assert prepare_prefill([b], 4, "cpu").metadata.slot_mapping.tolist()[4:6] == [0, 1]
    manager.check_invariants()
