# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 03: the block table, drawn
#
# A block table is a page table for the KV cache. A sequence is an ordered list of physical
# block ids, and logical position `p` lives in block `block_ids[p // block_size]` at offset
# `p % block_size`. The flat slot `block_id * block_size + offset` is the one integer that
# stage 04's paged pool will read and write.
#
# Every picture below is printed from a **live** `BlockTable` over a `BlockAllocator`: nothing
# is hard-coded, so if you point the next cell at your own implementation, the pictures (and the
# checks at the end of each section) are drawn from your code.

# %%
from nanoserve import grading

# Which implementations to draw: "ref" (the reference in src/nanoserve), "starter" (the stage's
# starter.py), a path to your own .py file (absolute, or relative to this notebook's folder), or a
# dotted module name -- the same values `pytest --impl` and `nanoserve check` accept.
IMPL = "ref"  # the BlockTable (stage 03), e.g. "../stages/03_block_table/starter.py"
ALLOCATOR_IMPL = "ref"  # the BlockAllocator under it (stage 02); point it at yours too

BlockTable = grading.load_impl(3, IMPL).BlockTable
BlockAllocator = grading.load_impl(2, ALLOCATOR_IMPL).BlockAllocator
print(f"drawing {BlockTable.__module__}.BlockTable over {BlockAllocator.__module__}.BlockAllocator")

# %% [markdown]
# ## Reaching a scattered layout through real calls
#
# A pool of 8 blocks of 16 slots. Six other sequences take one block each (ids 0..5, in order,
# because a fresh pool hands out ascending ids). Two of them finish: first the one on block 2,
# then the one on block 5. Reuse is last-in first-out, so the top of the free list is now 5,
# then 2.
#
# Our sequence then arrives: a 16-token prompt (prefill) and four decoded tokens, appended one
# at a time. Watch the free count: the prompt pulls one block, the first decoded token (position
# 16) crosses the capacity and pulls a second, and the other three land mid-block and touch no
# allocator at all.

# %%
BLOCK_SIZE = 16
allocator = BlockAllocator(8)
others = {f"other-{i}": BlockTable(allocator, BLOCK_SIZE) for i in range(6)}
for other in others.values():
    other.append(BLOCK_SIZE)
others.pop("other-2").free()
others.pop("other-5").free()

seq = BlockTable(allocator, BLOCK_SIZE)
seq.append(16)
print(f"prefill 16 tokens  -> block_ids {seq.block_ids}, free blocks {allocator.num_free_blocks}")
for _ in range(4):
    seq.append(1)
    print(
        f"decode 1 token     -> num_tokens {seq.num_tokens:2d}, block_ids {seq.block_ids}, "
        f"free blocks {allocator.num_free_blocks}"
    )

others.pop("other-3").free()  # one more finishes, so our blocks sit among free ones
assert seq.block_ids == [5, 2]

# %% [markdown]
# ## The picture: logical view, table, physical pool
#
# Left to right: the sequence's positions grouped by table index, the table itself, and the
# pool. In the pool a number is a position of our sequence, `o` a slot held by another
# sequence, `.` a slot of ours not yet written, and `-` a free block. Position 17 is bracketed.


# %%
def draw_logical(table, mark=None):
    """The sequence's positions, one row per table index."""
    print(f"logical positions ({table.num_tokens} tokens, block_size {table.block_size})")
    for index in range(table.num_blocks):
        start = index * table.block_size
        stop = min(start + table.block_size, table.num_tokens)
        cells = "".join(cell(p, mark) for p in range(start, stop))
        print(f"  index {index} |{cells}")


def draw_table(table):
    """The block table: which physical block each index points to."""
    print(f"block table {table.block_ids}")
    for index, block_id in enumerate(table.block_ids):
        print(f"  index {index} -> block {block_id}")


def draw_pool(table, num_blocks, other_tables, mark=None):
    """Every physical block as a row of slots, with who holds it."""
    owned = {block_id: name for name, t in other_tables.items() for block_id in t.block_ids}
    print(f"physical pool ({num_blocks} blocks x {table.block_size} slots)")
    for block_id in range(num_blocks):
        first_slot = block_id * table.block_size
        slots = f"{first_slot}..{first_slot + table.block_size - 1}"
        label = f"  block {block_id}  slots {slots:>8} |"
        print(label + pool_row(table, block_id, owned, mark))


def pool_row(table, block_id, owned, mark):
    """One block's slots, labelled by what lives in them."""
    if block_id in table.block_ids:
        index = table.block_ids.index(block_id)
        positions = range(index * table.block_size, (index + 1) * table.block_size)
        row = "".join(cell(p, mark) if p < table.num_tokens else "  . " for p in positions)
        return row + f"  ours, index {index}"
    if block_id in owned:
        return "  o " * table.block_size + f"  {owned[block_id]}"
    return "  - " * table.block_size + "  free"


def cell(p, mark):
    """A four-character cell for position p; the marked position is bracketed."""
    return f"[{p:2d}]" if p == mark else f" {p:2d} "


def draw_translation(table, p):
    """Position p through the table to its flat slot, showing the arithmetic."""
    block_id, offset = table.position(p)
    bs = table.block_size
    print(f"position {p}: index  = {p} // {bs} = {p // bs}  ->  block_ids[{p // bs}] = {block_id}")
    print(f"{'':{len(str(p)) + 11}}offset = {p} % {bs} = {offset}")
    print(f"{'':{len(str(p)) + 11}}slot   = {block_id} * {bs} + {offset} = {table.slot(p)}")


draw_logical(seq, mark=17)
print()
draw_table(seq)
print()
draw_pool(seq, 8, others, mark=17)
print()
draw_translation(seq, 17)

# %%
assert tuple(seq.position(17)) == (2, 1)
assert seq.slot(17) == 33

# %% [markdown]
# The model sees positions 0..19 in order; the pool holds them on blocks 5 and 2, with another
# sequence and free blocks between them. Translation does not care, and that gap between the two
# views is paging.
#
# ## Scattered reuse: sequence B runs on the memory A just vacated
#
# The day-log trace at block size 4: A takes 8 tokens on a fresh pool and gets blocks `[0, 1]`;
# A finishes and its blocks go back in table order (0, then 1), so the free list tops with 1,
# then 0. B then asks for 12 tokens at once and gets `[1, 0, 2]`: not a contiguous run.

# %%
small_pool = BlockAllocator(6)
seq_a = BlockTable(small_pool, 4)
seq_a.append(8)
print(f"A append(8)  -> block_ids {seq_a.block_ids}")
seq_a.free()
print(f"A free()     -> free blocks {small_pool.num_free_blocks}")
seq_b = BlockTable(small_pool, 4)
seq_b.append(12)
print(f"B append(12) -> block_ids {seq_b.block_ids}")
print()
draw_logical(seq_b, mark=5)
print()
draw_pool(seq_b, 6, {}, mark=5)
print()
draw_translation(seq_b, 5)

# %%
assert seq_b.block_ids == [1, 0, 2]
assert tuple(seq_b.position(5)) == (0, 1)
assert seq_b.slot(5) == 1

# %% [markdown]
# ## Decode growth equals prefill
#
# The contract this stage's tests pin down: growing a table one token at a time lands on the
# same blocks and slots as one bulk append, even on a scattered pool. If the two ever differed,
# prefill and decode would write the same token's K/V to different slots.


# %%
def scattered_pool():
    """A pool whose free list is shuffled by earlier allocations and frees."""
    pool = BlockAllocator(8)
    pool.allocate(5)
    pool.free([3, 0, 4])
    return pool


decode, prefill = BlockTable(scattered_pool(), 4), BlockTable(scattered_pool(), 4)
for _ in range(10):
    decode.append(1)
prefill.append(10)
print(f"ten append(1): block_ids {decode.block_ids}, slots {[decode.slot(p) for p in range(10)]}")
print(
    f"one append(10): block_ids {prefill.block_ids}, slots {[prefill.slot(p) for p in range(10)]}"
)
assert decode.block_ids == prefill.block_ids
assert [decode.slot(p) for p in range(10)] == [prefill.slot(p) for p in range(10)]
