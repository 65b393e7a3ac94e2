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
# # Stage 07: two block tables, one shared block
#
# Stage 07's block manager gives each full block of computed K/V a key: a chained hash of its
# tokens and of every block before it. A new prompt whose first pages have keys in the index
# points its block table at those blocks instead of computing them again, and each such block's
# **ref count** says how many live sequences hold it.
#
# This notebook runs the **live** stage-07 engine on a tiny random model, with the seed's
# prompts at block size 4: A = `[11 12 13 14 | 21 22 23 24 | 31 32 33]` first, then B =
# `[11 12 13 14 | 51 52 53 54 | 61 62 63 64 | 71]` while A is still running. Then a third
# request C arrives after A has finished and takes A's freed blocks back. The engine reports
# every step to `engine.on_step`. From those records the notebook draws each request's logical
# pages, the physical blocks they point at, and the blocks' ref counts. It then checks the
# drawing against the seed's trace and the tokens against stage 06, which shares nothing.
#
# To draw your own manager, open `notebooks/07_prefix_cache.py` in Jupyter (jupytext opens it as
# a notebook) and set `IMPL`. `pip install -e '.[notebooks]'` installs JupyterLab, jupytext and
# matplotlib; then `jupyter lab notebooks/` and, on the file, *Open With -> Jupytext Notebook*.

# %% tags=["hide-input"]
# Progress bars (saving the tiny checkpoint draws one) are only noise on a rendered page, and
# tqdm warns at import when the kernel has no ipywidgets.
import os
import warnings

os.environ["TQDM_DISABLE"] = "1"
warnings.filterwarnings("ignore", message="IProgress not found")

# %config InlineBackend.figure_format = "retina"

# %%
import tempfile
from typing import NamedTuple

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from nanoserve import LLM, SamplingParams, grading
from nanoserve.engine.loop.trace import StepRecord
from nanoserve.testing import save_tiny_model

# What to run: "ref" (the reference in src/nanoserve), "starter", a path to your own .py file
# (absolute, or relative to this notebook's folder) or a dotted module name: the values
# `pytest --impl` and `nanoserve check` accept. Its PrefixBlockManager runs the engine.
IMPL = "ref"

PrefixBlockManager = grading.load_impl(7, IMPL).PrefixBlockManager
print(f"PrefixBlockManager from {IMPL!r}: {PrefixBlockManager.__module__}")

# %% [markdown]
# ## The engine and the arrivals
#
# A tiny random Llama (two layers, float64), blocks of 4 tokens, a pool of 12 blocks. A arrives
# before step 1 and asks for 2 tokens. B arrives before step 2, after A's prefill has indexed A's
# two full pages. C arrives before step 4, after A has finished: it is A's prompt, then the token
# A generated first (its K/V completed A's third block during A's decode), then one more token.

# %%
folder = save_tiny_model(tempfile.mkdtemp(prefix="nanoserve-nb07-"), "llama")
BLOCK_SIZE, NUM_BLOCKS = 4, 12
A = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33]
B = [11, 12, 13, 14, 51, 52, 53, 54, 61, 62, 63, 64, 71]


def engine_of(stage: int, components=None):
    llm = LLM(folder, stage=stage, device="cpu", dtype="float64", block_size=BLOCK_SIZE,
              num_kv_blocks=NUM_BLOCKS, max_model_len=32, components=components)  # fmt: skip
    return llm.engine


class Snapshot(NamedTuple):
    """One step, copied out of the engine's StepRecord before the sequences move on."""

    step: int
    is_prefill: bool
    tables: dict[str, list[int]]  # request -> its block table, for every running request
    tokens: dict[str, list[int]]  # request -> its tokens whose K/V is stored after this step
    computed: dict[str, range]  # request -> the positions this step computed
    ref_counts: list[int]


def run(engine, arrivals: dict[int, tuple[str, object, int]]):
    """Step the engine, adding each request before its step; (snapshots, sequences by name).

    arrivals: step -> (name, prompt or a function of the sequences so far, max_tokens)."""
    names, seqs, snapshots = {}, {}, []

    def on_step(record: StepRecord) -> None:
        q = record.inputs.metadata.host.cu_seqlens_q
        running = engine.scheduler.running
        computed = {}
        for i, seq in enumerate(record.batch.seqs):
            start = len(seq) - (q[i + 1] - q[i]) if record.batch.is_prefill else len(seq) - 1
            computed[names[seq.seq_id]] = range(start, len(seq))
        stored = {names[s.seq_id]: s.num_cached_tokens for s in running}  # before this step
        stored.update({name: positions.stop for name, positions in computed.items()})
        snapshots.append(Snapshot(
            record.step, record.batch.is_prefill,
            {names[s.seq_id]: list(s.block_table) for s in running},
            {names[s.seq_id]: s.token_ids[: stored[names[s.seq_id]]] for s in running},
            computed, list(engine.manager.ref_counts),
        ))  # fmt: skip

    engine.on_step = on_step
    step = 1
    while step == 1 or engine.has_unfinished():
        if step in arrivals:
            name, prompt, max_tokens = arrivals[step]
            prompt = prompt(seqs) if callable(prompt) else prompt
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            seqs[name] = seq = engine.add_request(prompt, params)
            names[seq.seq_id] = name
        engine.step()
        engine.manager.check_invariants()
        step += 1
    return snapshots, seqs


ARRIVALS = {
    1: ("A", A, 2),
    2: ("B", B, 4),
    4: ("C", lambda seqs: [*A, seqs["A"].completion_token_ids[0], 5], 3),
}
engine = engine_of(7, {"PrefixBlockManager": PrefixBlockManager})
snapshots, seqs = run(engine, ARRIVALS)
for snap in snapshots:
    kind = "prefill" if snap.is_prefill else "decode "
    tables = "  ".join(f"{n} {t}" for n, t in snap.tables.items())
    held = {b: c for b, c in enumerate(snap.ref_counts) if c}
    print(f"step {snap.step} {kind}  {tables:<44} ref counts {held}")

# %% [markdown]
# ## Step 2: B's prefill, pointing at A's block
#
# The middle row is the **physical** pool, each block with its ref count. Above and below it,
# each request's **logical** pages in order, with the tokens whose K/V is stored (a `.` is a
# slot not written yet). An arrow is one entry of a block table. A hatched page was found in the cache and read, not computed. A solid page is computed
# in this step, and a pale page was computed in an earlier step. (The drawing code, plain
# matplotlib, is in the next cell of the notebook; the docs site hides it.)

# %% tags=["hide-input"]
COLOURS = {"A": "#0072B2", "B": "#E69F00", "C": "#009E73"}  # Okabe-Ito
REF_COLOURS = {0: "#f2f2f2", 1: "#e6cfe0", 2: "#b0709c"}  # free, held once, shared: no request hue
plt.rcParams["figure.dpi"] = 100


def page_state(snap: Snapshot, name: str, page: int, cached_upto: int) -> str:
    """'computed' in this step, 'cached' (found, not computed), or 'earlier'."""
    first = page * BLOCK_SIZE
    if name in snap.computed and first + BLOCK_SIZE > snap.computed[name].start:
        return "computed"
    return "cached" if first < cached_upto else "earlier"


def draw_tables(ax, snap: Snapshot, upper: str, lower: str, cached_upto: dict, title: str):
    """The pool in the middle, one request's logical pages above it and one's below, and one
    arrow per block-table entry."""
    for block in range(NUM_BLOCKS):
        count = snap.ref_counts[block]
        ax.add_patch(Rectangle((block - 0.45, -0.3), 0.9, 0.6, edgecolor="#555555",
                               facecolor=REF_COLOURS[min(count, 2)],
                               linewidth=1.6 if count > 1 else 0.6))  # fmt: skip
        ax.text(block, 0.07, f"{block}", ha="center", va="center", fontsize=10, weight="bold")
        ax.text(block, -0.17, f"ref {count}", ha="center", va="center", fontsize=7)
    ax.text(-1.2, 0, "pool", ha="right", va="center", fontsize=11)
    for name, y, side in ((upper, 1.4, -1), (lower, -1.4, 1)):  # side: toward the pool
        table, tokens = snap.tables[name], snap.tokens[name]
        colour = COLOURS[name]
        ax.text(-1.2, y, name, ha="right", va="center", fontsize=12, weight="bold", color=colour)
        for page, block in enumerate(table):
            x = page * 2.3  # logical pages, wider than the pool's blocks
            state = page_state(snap, name, page, cached_upto.get(name, 0))
            ax.add_patch(Rectangle(
                (x - 1.05, y - 0.3), 2.1, 0.6, edgecolor=colour, linewidth=1.2,
                facecolor="white" if state == "cached" else colour,
                alpha={"computed": 0.9, "cached": 1.0, "earlier": 0.25}[state],
                hatch="///" if state == "cached" else None,
            ))  # fmt: skip
            page_tokens = [str(t) for t in tokens[page * BLOCK_SIZE : (page + 1) * BLOCK_SIZE]]
            page_tokens += ["."] * (BLOCK_SIZE - len(page_tokens))  # slots with no K/V yet
            ink = "white" if state == "computed" else "black"
            ax.text(x, y + 0.08, " ".join(page_tokens), ha="center", va="center", fontsize=7.5,
                    color=ink, bbox=None if state != "cached" else
                    {"facecolor": "white", "edgecolor": "none", "pad": 1})  # fmt: skip
            ax.text(x, y - 0.17, f"page {page}", ha="center", va="center", fontsize=6.5,
                    color=ink)  # fmt: skip
            ax.add_patch(FancyArrowPatch(
                (x, y + 0.3 * side), (block, 0.3 * -side), arrowstyle="-|>", mutation_scale=9,
                color=colour, linewidth=1.0, alpha=0.85, shrinkA=0, shrinkB=1,
            ))  # fmt: skip
    ax.set_xlim(-2.4, NUM_BLOCKS)
    ax.set_ylim(-1.9, 1.9)
    ax.axis("off")
    ax.set_title(title, fontsize=11, loc="left")


def legend(fig) -> None:
    handles = [
        Patch(facecolor="white", edgecolor="#555555", hatch="///",
              label="page found in the cache: read, not computed"),
        Patch(facecolor="#777777", label="page computed in this step"),
        Patch(facecolor="#777777", alpha=0.25, label="page computed in an earlier step"),
        Patch(facecolor=REF_COLOURS[0], edgecolor="#555555", label="free block"),
        Patch(facecolor=REF_COLOURS[1], edgecolor="#555555", label="block held by one request"),
        Patch(facecolor=REF_COLOURS[2], edgecolor="#555555", label="block shared (ref count 2)"),
    ]  # fmt: skip
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8.5, frameon=False)


def snapshot_at(step: int) -> Snapshot:
    return next(s for s in snapshots if s.step == step)


# %%
b_prefill = snapshot_at(2)
fig, ax = plt.subplots(figsize=(10, 4.2), layout="constrained")
cached = {"B": seqs["B"].num_prompt_tokens - len(b_prefill.computed["B"])}
draw_tables(ax, b_prefill, "A", "B", cached, "step 2: B's prefill, while A is live")
legend(fig)
plt.show()

# %% [markdown]
# A holds blocks 0, 1 and 2. B's first page has A's tokens behind the same (empty) prefix, so its
# key matched A's block 0, and the block's stored tokens confirmed the hit. B points at block 0,
# whose ref count is now 2. B's second page differs from A's, so the lookup stopped there, and
# B's other three pages got fresh blocks 3, 4 and 5. B's prefill computed 9 tokens (positions 4
# to 12) and read the first 4 from block 0.

# %%
q = [0, len(b_prefill.computed["B"])]
print(f"B's table {b_prefill.tables['B']}, ref count of block 0: {b_prefill.ref_counts[0]}")
print(f"B's prefill computed positions {b_prefill.computed['B'].start}..{len(B) - 1}")
assert b_prefill.tables == {"A": [0, 1, 2], "B": [0, 3, 4, 5]}
assert b_prefill.ref_counts[:6] == [2, 1, 1, 1, 1, 1] and sum(b_prefill.ref_counts[6:]) == 0
assert b_prefill.computed["B"] == range(4, 13), "B computes 9 tokens, from position 4"

# %% [markdown]
# ## Step 4: A has finished, and C takes its blocks back
#
# A finished in step 3. Its release walked its table last block first: blocks 2 and 1 fell to
# count 0 and went back to the free list, and block 0 fell to 1 (B still holds it). The freed
# blocks kept their keys. Block 2 is full too by now: A's decode of its first generated token
# filled it, and it was indexed after that step.
#
# C is A's 11 tokens, A's first generated token and one more. Its first page is B's (live) block
# 0, and its next two are A's freed blocks 1 and 2. Both are taken back from the free list. That
# is 12 cached tokens of 13, and the last one is computed into a fresh block.

# %%
c_prefill = snapshot_at(4)
fig, ax = plt.subplots(figsize=(10, 4.2), layout="constrained")
cached = {"C": seqs["C"].num_prompt_tokens - len(c_prefill.computed["C"])}
draw_tables(ax, c_prefill, "B", "C", cached, "step 4: C's prefill, after A finished")
legend(fig)
plt.show()

# %%
c_table = c_prefill.tables["C"]
print(f"C's table {c_table}; ref counts of blocks 0, 1, 2: {c_prefill.ref_counts[:3]}")
assert c_table[:3] == [0, 1, 2], "C shares block 0 with B and reclaims A's blocks 1 and 2"
assert c_prefill.ref_counts[:3] == [2, 1, 1]
assert c_prefill.computed["C"] == range(12, 13), "C computes only its last token"
assert c_table[3] not in (0, 1, 2, 3, 4, 5)

# %% [markdown]
# ## The same tokens from fewer computed prompt tokens
#
# Stage 06 runs the same arrivals and shares nothing: it computes every prompt token. Each
# request's tokens must be identical, and at the end every block is free again.

# %%
plain = engine_of(6)
_, plain_seqs = run(plain, ARRIVALS)
for name in ARRIVALS.values():
    name = name[0]
    same = plain_seqs[name].token_ids == seqs[name].token_ids
    print(f"{name}: {seqs[name].completion_token_ids}  identical to stage 06: {same}")
    assert same
print(f"prompt tokens computed: stage 06 {plain.num_prefill_tokens}, "
      f"stage 07 {engine.num_prefill_tokens}")  # fmt: skip
assert (plain.num_prefill_tokens, engine.num_prefill_tokens) == (11 + 13 + 13, 11 + 9 + 1)
assert engine.manager.num_free_blocks == NUM_BLOCKS and not any(engine.manager.ref_counts)
