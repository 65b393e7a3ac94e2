"""Draw one figure per stage: docs/figures/NN_slug.svg, at the top of docs/stages/NN_slug.md.

Run `python tools/stage_figures.py [OUT_DIR]` (default docs/figures) after changing a mechanism a
figure shows; tests/test_docs_site.py re-runs it into a temporary folder. The block pictures
(stages 02 to 04, 07) are drawn from the reference BlockAllocator and BlockTable as they run;
the others are diagrams of the mechanism. Needs matplotlib (the `docs` extra).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from nanoserve.engine.memory.allocator import BlockAllocator
from nanoserve.engine.memory.block_table import BlockTable

ROOT = Path(__file__).resolve().parents[1]
COLORS = {"A": "#7fb3d5", "B": "#f5b041", "C": "#82e0aa", "free": "#ecf0f1", "hi": "#f1948a"}
plt.rcParams.update(
    {
        "svg.fonttype": "none",
        "svg.hashsalt": "nanoserve",
        "font.size": 9,
        "font.family": "sans-serif",
    }
)


def canvas(width: float, height: float, title: str):
    """A figure whose data units are inches, axes hidden."""
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return fig, ax


def box(ax, x, y, w, h, text="", color="#ffffff", size=9):
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="#34495e", lw=0.8)
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def arrow(ax, start, end, text="", color="#34495e"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=9, color=color))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.08, text, ha="center", size=8)


def cells(ax, x, y, labels, colors, size=0.32, hatch=None):
    """A row of square cells from (x, y), left to right."""
    for i, (label, color) in enumerate(zip(labels, colors)):
        ax.add_patch(
            Rectangle((x + i * size, y), size, size, fc=color, ec="#34495e", lw=0.6, hatch=hatch)
        )
        ax.text(x + (i + 0.5) * size, y + size / 2, str(label), ha="center", va="center", size=7)


def flow(ax, y, steps, x=0.2, w=1.05, gap=0.3, h=0.45):
    """Boxes left to right joined by arrows; steps are (text, color)."""
    for i, (text, color) in enumerate(steps):
        left = x + i * (w + gap)
        box(ax, left, y, w, h, text, color, size=8)
        if i:
            arrow(ax, (left - gap, y + h / 2), (left, y + h / 2))


# ---- one function per stage ----------------------------------------------------------------------
def model():
    fig, ax = canvas(10, 2.2, "A decoder-only model: one forward pass, token ids to logits")
    box(ax, 2.55, 0.25, 4.3, 1.45, "", "#fdfefe")
    ax.text(4.7, 1.5, "× num_hidden_layers", ha="center", size=8, style="italic")
    flow(ax, 0.75, [("token ids", "#ffffff"), ("embed", COLORS["A"])], x=0.2, w=0.85)
    inner = [("RMSNorm,\nattention", COLORS["B"]), ("+ residual", "#ffffff")]
    inner += [("RMSNorm,\nMLP", COLORS["C"]), ("+ residual", "#ffffff")]
    flow(ax, 0.55, inner, x=2.65, w=0.9, gap=0.15, h=0.8)
    arrow(ax, (2.2, 0.97), (2.65, 0.97))
    flow(ax, 0.75, [("RMSNorm", COLORS["A"]), ("lm_head:\nlogits", COLORS["A"])], x=7.1, w=0.9)
    arrow(ax, (6.85, 0.97), (7.1, 0.97))
    return fig


def contiguous_cache():
    fig, ax = canvas(6.5, 2.1, "Contiguous cache: every sequence reserves max_model_len slots")
    for row, (name, used) in enumerate([("A", 5), ("B", 11), ("C", 3)]):
        y = 1.35 - row * 0.5
        ax.text(0.15, y + 0.16, name, va="center", size=9)
        colors = [COLORS[name]] * used + [COLORS["free"]] * (16 - used)
        cells(ax, 0.45, y, ["" for _ in range(16)], colors)
        ax.text(0.45 + 16 * 0.32 + 0.1, y + 0.16, f"{used} used, {16 - used} idle", size=8)
    return fig


def block_allocator():
    allocator = BlockAllocator(8)
    held = {"A": allocator.allocate(3), "B": allocator.allocate(2)}
    allocator.free(held.pop("A"))  # A finishes: its ids go back on top of the stack
    owner = {i: name for name, ids in held.items() for i in ids}
    next_ids = copy.deepcopy(allocator).allocate(allocator.num_free_blocks)  # the stack, top first
    fig, ax = canvas(6.5, 1.9, "Block allocator: B holds 2 blocks; A has freed its 3")
    ax.text(0.2, 1.25, "pool", size=9)
    cells(
        ax, 1.0, 1.15, range(8), [COLORS[owner[i]] if i in owner else "#ffffff" for i in range(8)]
    )
    ax.text(0.2, 0.45, "handed\nout next", size=8, va="center")
    cells(ax, 1.0, 0.3, next_ids, [COLORS["free"]] * len(next_ids))
    ax.text(1.0 + len(next_ids) * 0.32 + 0.15, 0.45, "← LIFO: last freed, first reused", size=8)
    return fig


def _tables(block_size=4):
    """Two sequences growing in turn on one allocator, as the reference BlockTable does it."""
    allocator = BlockAllocator(8)
    tables = {"A": BlockTable(allocator, block_size), "B": BlockTable(allocator, block_size)}
    for name, n in [("A", 6), ("B", 5), ("A", 3), ("B", 4)]:
        tables[name].append(n)
    return tables


def block_table():
    tables = _tables()
    fig, ax = canvas(6.5, 2.3, "Block table: logical blocks (left) to physical blocks (right)")
    owner = {b: n for n, t in tables.items() for b in t.block_ids}
    cells(ax, 3.8, 0.9, range(8), [COLORS.get(owner.get(i, ""), "#ffffff") for i in range(8)])
    ax.text(3.8 + 8 * 0.32 + 0.1, 1.06, "the pool", size=8, va="center")
    for row, (name, table) in enumerate(tables.items()):
        y = 1.6 - row * 1.2
        ax.text(0.1, y + 0.16, f"{name} ({table.num_tokens} tokens)", size=8, va="center")
        cells(ax, 1.3, y, [f"L{i}" for i in range(table.num_blocks)], [COLORS[name]] * 4)
        for i, block_id in enumerate(table.block_ids):
            start = (1.3 + (i + 0.5) * 0.32, y + (0 if row == 0 else 0.32))
            end = (3.8 + (block_id + 0.5) * 0.32, 0.9 + (0.32 if row == 0 else 0))
            arrow(ax, start, end, color=COLORS[name])
    return fig


def paged_pool():
    tables = _tables()
    fig, ax = canvas(6.5, 1.9, "Paged KV pool: a token's slot = block_id × block_size + offset")
    slots = {t.slot(p): (n, p) for n, t in tables.items() for p in range(t.num_tokens)}
    for block_id in range(8):
        x = 0.3 + block_id * 0.75
        colors = [
            COLORS[slots[s][0]] if s in slots else "#ffffff"
            for s in range(4 * block_id, 4 * block_id + 4)
        ]
        labels = [slots[s][1] if s in slots else "" for s in range(4 * block_id, 4 * block_id + 4)]
        ax.text(x + 0.32, 1.3, f"block {block_id}", ha="center", size=7)
        for j, (label, color) in enumerate(zip(labels, colors)):
            cells(ax, x + (j % 2) * 0.32, 0.85 - (j // 2) * 0.32, [label], [color])
    ax.text(0.3, 0.2, "numbers: each sequence's token positions (A blue, B orange)", size=8)
    return fig


def triton_store():
    fig, ax = canvas(6.5, 2.0, "Store kernel: one program per token writes its K and V to its slot")
    cells(ax, 0.3, 1.3, ["t0", "t1", "t2", "t3", "t4"], [COLORS["A"]] * 5, size=0.45)
    ax.text(0.3, 1.85, "new tokens' K, V (one step)", size=8)
    slot_mapping = [9, 10, 11, 4, 5]
    cells(ax, 3.2, 0.3, range(16), [COLORS["free"]] * 16, size=0.2)
    ax.text(3.2, 0.6, "cache slots", size=8)
    for i, slot in enumerate(slot_mapping):
        arrow(ax, (0.3 + (i + 0.5) * 0.45, 1.3), (3.2 + (slot + 0.5) * 0.2, 0.5), color="#2e86c1")
    ax.text(0.3, 0.3, "slot_mapping = [9, 10, 11, 4, 5]", size=8, family="monospace")
    return fig


def paged_attention():
    fig, ax = canvas(6.5, 2.0, "Paged decode attention: a query reads its pages through the table")
    box(ax, 0.2, 0.8, 0.9, 0.45, "query of A", COLORS["A"], 8)
    cells(ax, 1.6, 0.85, ["5", "0", "7"], [COLORS["A"]] * 3, size=0.35)
    ax.text(1.6, 1.35, "block_tables[A]", size=8)
    arrow(ax, (1.1, 1.02), (1.6, 1.02))
    for block_id in range(8):
        color = COLORS["A"] if block_id in (5, 0, 7) else COLORS["free"]
        box(ax, 3.3 + block_id * 0.38, 0.8, 0.3, 0.45, str(block_id), color, 7)
    for i, block_id in enumerate([5, 0, 7]):
        start = (1.6 + (i + 0.5) * 0.35, 0.85)
        arrow(ax, start, (3.45 + block_id * 0.38, 0.8), color="#2e86c1")
    ax.text(3.3, 1.45, "KV pages (blocks) in the cache", size=8)
    ax.text(
        0.2,
        0.25,
        "softmax(q·Kᵀ/√d)·V over the pages in table order; unused blocks untouched",
        size=8,
    )
    return fig


def prefix_cache():
    allocator = BlockAllocator(8)
    a, b = BlockTable(allocator, 4), BlockTable(allocator, 4)
    a.append(10)
    b.adopt(a.block_ids[:2])  # B's prompt starts with A's first 8 tokens: their blocks are shared
    b.append(11)
    fig, ax = canvas(6.5, 2.1, "Prefix cache: two tables, shared full blocks (found by hash)")
    for row, (name, table) in enumerate([("A", a), ("B", b)]):
        y = 1.35 - row * 0.7
        ax.text(0.2, y + 0.16, name, size=9, va="center")
        colors = [COLORS["hi"] if i < 2 else COLORS[name] for i in range(table.num_blocks)]
        cells(ax, 0.6, y, table.block_ids, colors, size=0.45)
    ax.text(
        3.3, 1.0, "red: the same physical blocks, counted twice\n(freed when both let go)", size=8
    )
    return fig


def cuda_graphs():
    fig, ax = canvas(6.5, 1.9, "CUDA graphs: one replay instead of a launch per kernel")
    ax.text(0.1, 1.3, "eager", size=8, va="center")
    for i in range(10):
        ax.add_patch(Rectangle((1.0 + i * 0.5, 1.15), 0.12, 0.3, fc="#f5b041"))
        ax.add_patch(Rectangle((1.12 + i * 0.5, 1.15), 0.3, 0.3, fc=COLORS["A"]))
    ax.text(0.1, 0.55, "graph", size=8, va="center")
    ax.add_patch(Rectangle((1.0, 0.4), 0.12, 0.3, fc="#f5b041"))
    ax.add_patch(Rectangle((1.12, 0.4), 3.0, 0.3, fc=COLORS["A"]))
    ax.text(1.0, 0.05, "orange: CPU launch overhead    blue: GPU kernel time", size=8)
    return fig


def tensor_parallel():
    fig, ax = canvas(7.5, 2.2, "Tensor parallelism: split columns, then rows, one all-reduce")
    box(ax, 0.2, 0.85, 0.6, 0.45, "x", "#ffffff")
    for rank in range(2):
        y = 1.4 - rank * 1.0
        box(ax, 1.3, y, 1.8, 0.45, f"gate/up columns, rank {rank}", COLORS["A"], 8)
        box(ax, 3.5, y, 1.6, 0.45, f"down rows, rank {rank}", COLORS["B"], 8)
        arrow(ax, (0.8, 1.07), (1.3, y + 0.22))
        arrow(ax, (3.1, y + 0.22), (3.5, y + 0.22))
        arrow(ax, (5.1, y + 0.22), (5.6, 1.07))
    box(ax, 5.6, 0.85, 1.5, 0.45, "all-reduce: sum", COLORS["C"], 8)
    return fig


def serving():
    fig, ax = canvas(9, 1.6, "Serving: HTTP requests to one engine loop and back, token by token")
    steps = [
        ("client", "#ffffff"),
        ("FastAPI route", COLORS["A"]),
        ("AsyncEngine queue", COLORS["B"]),
    ]
    steps += [("engine thread:\nstep()", COLORS["C"]), ("token deltas →\nSSE stream", COLORS["A"])]
    flow(ax, 0.5, steps, x=0.2, w=1.45, gap=0.3, h=0.6)
    return fig


def overlap():
    fig, ax = canvas(
        7.2, 1.9, "Overlap scheduling: the host prepares step n+1 while the GPU runs n"
    )
    for row, (name, offset) in enumerate([("host", 0.0), ("device", 0.6)]):
        y = 1.2 - row * 0.6
        ax.text(0.1, y + 0.12, name, size=8, va="center")
        for step in range(4):
            x = 0.9 + offset + step * 1.3
            color = "#f5b041" if name == "host" else COLORS["A"]
            box(ax, x, y, 1.15, 0.3, f"{'schedule' if name == 'host' else 'run'} {step}", color, 7)
    ax.text(0.9, 0.1, "no gap on the device: its next batch is ready when it finishes", size=8)
    return fig


def speculative():
    title = "Speculative decoding: guess k tokens, verify them in one forward, keep the agreed ones"
    fig, ax = canvas(7.5, 2.0, title)
    ax.text(0.1, 1.35, "proposed", size=8, va="center")
    cells(ax, 1.0, 1.2, ["the", "cat", "sat", "up"], [COLORS["B"]] * 4, size=0.5)
    ax.text(0.1, 0.7, "target", size=8, va="center")
    target = [("the", COLORS["C"]), ("cat", COLORS["C"]), ("sat", COLORS["C"]), ("on", "#ffffff")]
    cells(ax, 1.0, 0.55, [t for t, _ in target], [c for _, c in target], size=0.5)
    ax.add_patch(Rectangle((2.5, 1.2), 0.5, 0.5, fill=False, ec=COLORS["hi"], lw=2))
    note = "3 accepted + the target's own 4th token: 4 tokens for one forward pass;\n"
    note += "the rejected guess's KV slot is rolled back in the block table"
    ax.text(3.4, 0.95, note, size=8, va="center")
    return fig


def fp8_kv_cache():
    title = "FP8 KV cache: one byte per K/V value, one power-of-two scale per (block, KV head)"
    fig, ax = canvas(7.5, 2.1, title)
    ax.text(0.1, 1.55, "values", size=8, va="center")
    cells(ax, 1.0, 1.4, ["1.3", "-0.5", "0.2", "3.1"], [COLORS["A"]] * 4, size=0.5)
    ax.text(3.2, 1.65, "amax 3.1: the smallest e with 3.1 <= 448 * 2**e", size=8, va="center")
    ax.text(3.2, 1.45, "is e = -7 (one int32 per block and head)", size=8, va="center")
    ax.text(0.1, 0.85, "codes", size=8, va="center")
    codes = ["0x72", "0xE8", "0x5D", "0x7C"]
    cells(ax, 1.0, 0.7, codes, [COLORS["B"]] * 4, size=0.5)
    ax.text(3.2, 0.85, "x * 2**7, rounded to e4m3: one byte each (uint8)", size=8, va="center")
    ax.text(0.1, 0.25, "read as", size=8, va="center")
    cells(ax, 1.0, 0.1, ["1.25", "-0.5", "0.203", "3.0"], [COLORS["C"]] * 4, size=0.5)
    note = "code * 2**-7, exactly: the loss is all in the rounding;\n"
    note += "the kernels dequantize in registers, the pool holds ~2x the tokens"
    ax.text(3.2, 0.25, note, size=8, va="center")
    return fig


FIGURES: dict[str, Callable] = {
    "00_model": model,
    "01_contiguous_cache": contiguous_cache,
    "02_block_allocator": block_allocator,
    "03_block_table": block_table,
    "04_paged_pool": paged_pool,
    "05_triton_store": triton_store,
    "06_paged_attention": paged_attention,
    "07_prefix_cache": prefix_cache,
    "08_cuda_graphs": cuda_graphs,
    "09_tensor_parallel": tensor_parallel,
    "10_serving": serving,
    "11_overlap": overlap,
    "12_speculative": speculative,  # for the stage-12 page, written apart from this script
    "13_fp8_kv_cache": fp8_kv_cache,
}


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for stem, draw in FIGURES.items():
        fig = draw()
        fig.savefig(out_dir / f"{stem}.svg", bbox_inches="tight", metadata={"Date": None})
        plt.close(fig)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "figures")
