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
# checks at the end of each section) are drawn from your code. The docs site shows this notebook
# as the reference draws it, run when the site was built; to draw yours, open
# `notebooks/03_block_table.py` in Jupyter (jupytext opens it as a notebook) and set `IMPL`.
# `pip install -e '.[notebooks]'` installs JupyterLab, jupytext and matplotlib; then
# `jupyter lab notebooks/` and, on the file, *Open With -> Jupytext Notebook*.

# %% tags=["hide-input"]
# nanoserve imports tqdm, which warns at import in a kernel without ipywidgets: only noise here.
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")

# Figures at twice the pixels, shown at their own size: sharp on high-density screens.
# %config InlineBackend.figure_format = "retina"

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Rectangle

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
# pool. Each table index has its own colour, and the arrows follow it from the logical row
# through the table to the physical block, where the same positions sit. Grey blocks are held by
# other sequences, white ones are free, and a dashed cell is a slot of ours not yet written.
# Position 17 is framed in red in both views, and its translation is written underneath. (The
# drawing code, plain matplotlib, is in the next cell of the notebook; the docs site hides it.)

# %% tags=["hide-input"]
# One colour per table index (Okabe-Ito, readable with colour-vision deficiencies); red frames
# the marked position. Geometry is in cells (one slot = one unit square).
INDEX_COLOURS = ["#56B4E9", "#E69F00", "#009E73", "#CC79A7", "#0072B2", "#F0E442"]
OTHER, MARK = "#bdbdbd", "#d62728"
CELL_INCHES = 0.22
TABLE_WIDTH, GAP, LABEL_WIDTH = 3.6, 2.2, 8.5  # table column, space either side, pool labels
plt.rcParams["figure.dpi"] = 100


def draw_block_map(table, num_blocks, other_tables, mark=None, title=""):
    """Logical rows -> table entries -> physical blocks, read from a live table."""
    bs = table.block_size
    table_x = bs + GAP  # left edge of the table column
    pool_x = table_x + TABLE_WIDTH + GAP  # left edge of the pool
    left, right, top, bottom = -3.2, pool_x + bs + LABEL_WIDTH, -3.6, num_blocks + 1.6
    size = (CELL_INCHES * (right - left), CELL_INCHES * (bottom - top))
    _, ax = plt.subplots(figsize=size)
    ax.set_position((0, 0, 1, 1))  # the axes fill the figure: one cell is CELL_INCHES wide
    ax.set_xlim(left, right)
    ax.set_ylim(bottom, top)  # row 0 at the top
    ax.axis("off")
    ax.text(left, top + 0.2, title, va="top", fontsize=10, weight="bold")
    headers = [
        (bs / 2, f"logical positions\n({table.num_tokens} tokens)"),
        (table_x + TABLE_WIDTH / 2, "block\ntable"),
        (pool_x + bs / 2, f"physical pool\n({num_blocks} x {bs} slots)"),
    ]
    for x, text in headers:
        ax.text(x, -0.4, text, ha="center", va="bottom", fontsize=8.5)
    draw_logical_rows(ax, table, mark)
    draw_table_column(ax, table, table_x, pool_x)
    draw_pool_rows(ax, table, num_blocks, other_tables, pool_x, mark)
    if mark is not None:
        ax.text(
            left,
            num_blocks + 0.5,
            translation(table, mark),
            family="monospace",
            fontsize=8.5,
            va="top",
            color=MARK,
        )
    plt.show()


def slot_cell(ax, x, y, fill, text="", edge="white", style="-"):
    """One slot: a unit square with an optional label."""
    ax.add_patch(
        Rectangle((x, y), 1, 1, facecolor=fill, edgecolor=edge, linestyle=style, linewidth=0.8)
    )
    if text:
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=6.5)


def position_cells(ax, table, index, x, y):
    """The slots of table index `index`, labelled with the positions they hold."""
    colour = INDEX_COLOURS[index % len(INDEX_COLOURS)]
    for offset in range(table.block_size):
        p = index * table.block_size + offset
        if p < table.num_tokens:
            slot_cell(ax, x + offset, y, colour, str(p))
        else:
            slot_cell(ax, x + offset, y, "white", edge=colour, style="--")


def draw_logical_rows(ax, table, mark):
    """One row per table index: the positions it covers, in order."""
    for index in range(table.num_blocks):
        ax.text(-0.3, index + 0.5, f"index {index}", ha="right", va="center", fontsize=8)
        position_cells(ax, table, index, 0, index)
    if mark is not None:
        outline(ax, mark % table.block_size, mark // table.block_size)


def draw_table_column(ax, table, table_x, pool_x):
    """The table's entries, with arrows from the logical rows and to the physical blocks."""
    for index, block_id in enumerate(table.block_ids):
        colour = INDEX_COLOURS[index % len(INDEX_COLOURS)]
        ax.add_patch(
            FancyBboxPatch(
                (table_x, index + 0.1),
                TABLE_WIDTH,
                0.8,
                boxstyle="round,pad=0.02",
                facecolor=colour,
                edgecolor="black",
                linewidth=0.6,
            )
        )
        ax.text(
            table_x + TABLE_WIDTH / 2,
            index + 0.5,
            f"[{index}] = {block_id}",
            ha="center",
            va="center",
            fontsize=8,
            weight="bold",
        )
        arrow(ax, (table.block_size + 0.1, index + 0.5), (table_x - 0.1, index + 0.5), colour)
        arrow(
            ax, (table_x + TABLE_WIDTH + 0.1, index + 0.5), (pool_x - 0.1, block_id + 0.5), colour
        )


def draw_pool_rows(ax, table, num_blocks, other_tables, pool_x, mark):
    """Every physical block as a row of slots, coloured by who holds it."""
    bs = table.block_size
    owned = {block_id: name for name, t in other_tables.items() for block_id in t.block_ids}
    for block_id in range(num_blocks):
        if block_id in table.block_ids:
            position_cells(ax, table, table.block_ids.index(block_id), pool_x, block_id)
        else:
            fill, edge = (OTHER, "white") if block_id in owned else ("white", "#dddddd")
            for offset in range(bs):
                slot_cell(ax, pool_x + offset, block_id, fill, edge=edge)
            ax.text(
                pool_x + bs / 2,
                block_id + 0.5,
                owned.get(block_id, "free"),
                ha="center",
                va="center",
                fontsize=7,
                color="#555555",
                bbox={"facecolor": fill, "edgecolor": "none", "pad": 1},
            )
        first = block_id * bs
        label = f"block {block_id}: slots {first}..{first + bs - 1}"
        ax.text(pool_x + bs + 0.4, block_id + 0.5, label, va="center", fontsize=8)
    if mark is not None:
        block_id, offset = table.position(mark)
        outline(ax, pool_x + offset, block_id)


def outline(ax, x, y):
    """A red frame around one cell."""
    ax.add_patch(Rectangle((x, y), 1, 1, fill=False, edgecolor=MARK, linewidth=2, zorder=5))


def arrow(ax, start, end, colour):
    """A plain arrow in a table index's colour."""
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops={"arrowstyle": "-|>", "color": colour, "lw": 1.5, "shrinkA": 0, "shrinkB": 0},
    )


def translation(table, p):
    """Position p through the table to its flat slot, showing the arithmetic."""
    block_id, offset = table.position(p)
    bs = table.block_size
    return (
        f"position {p}:  index {p} // {bs} = {p // bs}  ->  block_ids[{p // bs}] = {block_id};"
        f"  offset {p} % {bs} = {offset};  slot {block_id} * {bs} + {offset} = {table.slot(p)}"
    )


# %%
draw_block_map(seq, 8, others, mark=17, title="A 20-token sequence on blocks [5, 2]")

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
draw_block_map(seq_b, 6, {}, mark=5, title="B runs on the blocks A just freed: [1, 0, 2]")

# %%
assert seq_b.block_ids == [1, 0, 2]
assert tuple(seq_b.position(5)) == (0, 1)
assert seq_b.slot(5) == 1

# %% [markdown]
# ## The walk-through's fragmented table
#
# The nano-vLLM walk-through's example of a fragmented table, at block size 4: a sequence whose
# table is `[0, 4, 7]`, where position 6 lands on physical page 4 at offset 2, slot 18. Here it
# is reached the same way a real pool gets there: eight sequences take a block each, then the
# ones on blocks 7, 4 and 0 finish in that order, so the free list tops with 0, then 4, then 7.
# An 11-token prompt then pulls three blocks.

# %%
fragmented_pool = BlockAllocator(8)
holders = {f"other-{i}": BlockTable(fragmented_pool, 4) for i in range(8)}
for holder in holders.values():
    holder.append(4)
for name in ["other-7", "other-4", "other-0"]:
    holders.pop(name).free()
seq_c = BlockTable(fragmented_pool, 4)
seq_c.append(11)
print(f"append(11) -> block_ids {seq_c.block_ids}")
draw_block_map(seq_c, 8, holders, mark=6, title="A fragmented table: [0, 4, 7]")

# %%
assert seq_c.block_ids == [0, 4, 7]
assert tuple(seq_c.position(6)) == (4, 2)
assert seq_c.slot(6) == 18

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
