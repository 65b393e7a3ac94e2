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
# # Stage 06: which pages each decode program reads
#
# Stage 06's decode kernel never gathers a sequence's K/V into a contiguous copy: each program
# walks the sequence's **block table** and reads the pages in place. Its grid is
# `(B, H_kv, num_partitions)`: one program per sequence, per KV group (all query heads that share
# a KV head sit in one tile, so each page is read once per group, not once per query head) and,
# when the context is split (split-K, flash-decoding), per partition of `partition_size`
# positions. The reduce kernel then merges the partitions' partial softmaxes.
#
# This notebook runs the **live** stage-06 engine on a tiny random model, takes one decode step's
# block tables and context lengths from the engine's own step record (`engine.on_step`), and
# draws, for every decode program of that step, which physical blocks of the pool it reads. It
# then checks the drawing against the block tables, and runs the real decode kernel on that
# step with every block the drawing says nobody reads set to NaN: the output stays finite.

# %% tags=["hide-input"]
# Progress bars are only noise on a rendered page. The kernel check at the end runs the decode
# kernel on CPU tensors through Triton's interpreter, asked for before triton is first imported.
import os
import warnings

os.environ["TQDM_DISABLE"] = "1"
warnings.filterwarnings("ignore", message="IProgress not found")
os.environ["TRITON_INTERPRET"] = "1"

# %config InlineBackend.figure_format = "retina"

# %%
import tempfile
from typing import NamedTuple

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch, Rectangle

from nanoserve import LLM, SamplingParams, grading
from nanoserve.engine.loop.trace import StepRecord
from nanoserve.kernels.paged_decode import decode_partition_size
from nanoserve.testing import save_tiny_model

# %% [markdown]
# ## Your kernels, or the reference's
#
# `IMPL` is the stage-06 file the notebook runs, as `nanoserve check 6 --impl` takes it: "ref"
# (the reference), "starter", or your file, a path relative to this folder (e.g.
# `"../mine.py"`). With your file the engine below runs your two kernels on the `triton`
# backend (Triton's interpreter here), and the check at the end calls your decode kernel.

# %%
IMPL = "ref"
kernels = grading.load_impl(6, IMPL)
paged_attention_decode = kernels.paged_attention_decode
yours = None if IMPL == "ref" else vars(kernels)  # ref: the engine's own choice, the torch oracle
print(f"stage-06 kernels from {IMPL!r}: {', '.join(vars(kernels))}")

# %% [markdown]
# ## A tiny model and a small live batch
#
# Two layers, 4 query heads and 2 KV heads (two KV groups of 2 query heads) of dimension 16,
# random weights, float64. Blocks of 4 tokens. Four requests of different prompt lengths decode
# side by side; we keep the block tables and context lengths of every step the engine runs.

# %%
folder = save_tiny_model(tempfile.mkdtemp(prefix="nanoserve-nb06-"), "llama")
BLOCK_SIZE, NUM_BLOCKS = 4, 24
llm = LLM(folder, stage=6, device="cpu", dtype="float64", block_size=BLOCK_SIZE,
          num_kv_blocks=NUM_BLOCKS, max_model_len=64, components=yours,
          attention_backend="auto" if yours is None else "triton")  # fmt: skip
engine = llm.engine
num_kv_heads = engine.runner.cache.kv.shape[4]
num_heads = engine.runner.model.config.num_attention_heads
print(
    f"{llm.engine.runner.attention.name!r} backend on the CPU; H = {num_heads}, "
    f"H_kv = {num_kv_heads}: {num_kv_heads} KV groups of {num_heads // num_kv_heads} heads"
)


class DecodeStep(NamedTuple):
    """What the decode kernel is given in one step, copied out of the engine's StepRecord."""

    step: int
    names: list[str]  # the batch's requests, in row order
    context_lens: list[int]  # row b attends context_lens[b] positions
    block_tables: list[list[int]]  # row b's table, padded with -1 to the batch's widest


NAMES = {}  # seq_id -> request name
decode_steps: list[DecodeStep] = []


def on_step(record: StepRecord) -> None:
    md = record.inputs.metadata
    if record.batch.is_prefill:
        return
    decode_steps.append(DecodeStep(
        record.step, [NAMES[seq.seq_id] for seq in record.batch.seqs],
        md.context_lens.tolist(), md.block_tables.tolist(),
    ))  # fmt: skip
    # the device tensors the kernel reads hold the same as the host lists the cache built
    assert md.host.context_lens == decode_steps[-1].context_lens
    assert [row[: len(t)] for row, t in zip(md.block_tables.tolist(), md.host.block_tables)] == [
        list(t) for t in md.host.block_tables
    ]


PROMPT_LENS = {"A": 13, "B": 3, "C": 22, "D": 7}
engine.on_step = on_step
for i, (name, n) in enumerate(PROMPT_LENS.items()):
    prompt = torch.randint(256, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    NAMES[seq.seq_id] = name
while engine.has_unfinished():
    engine.step()
step = decode_steps[3]  # the fourth decode step: every request still running
for name, n, table in zip(step.names, step.context_lens, step.block_tables):
    print(f"{name}: context {n:2d}, block table {table}")

# %% [markdown]
# ## The decode grid, and what each program reads
#
# The kernel picks `partition_size` from static shapes only (`decode_partition_size`: split only
# when `B * H_kv` programs cannot fill the GPU, and then into partitions of no fewer than 256
# positions), so on this tiny batch it would not split at all. To see split-K, we draw the grid with partitions of 16
# positions (4 blocks). Program `(b, g, p)` reads positions `p * 16 .. min((p + 1) * 16,
# context_lens[b]) - 1`, and position `n` lives in block `block_tables[b][n // block_size]`. The
# number of partitions is static too, `cdiv(table width * block_size, 16)`: a program whose
# partition starts past its sequence's context exits at once (partition 0 always runs, so a
# padding row still writes zeros).

# %%
PARTITION_SIZE = 16
width = len(step.block_tables[0])
max_context_len = width * BLOCK_SIZE  # what the padded table can address
num_partitions = -(-max_context_len // PARTITION_SIZE)
kernel_choice = decode_partition_size(len(step.names), num_kv_heads, max_context_len, "cpu")
print(
    f"the kernel's own choice here: partition_size {kernel_choice} (one partition); "
    f"drawn with {PARTITION_SIZE}: grid ({len(step.names)}, {num_kv_heads}, {num_partitions})"
)


class Program(NamedTuple):
    """One decode program and the physical blocks it reads, in the order it reads them."""

    name: str
    row: int  # b
    group: int  # g: the kv head its GROUP query heads share
    partition: int  # p
    positions: range
    blocks: list[int]


def programs_of(step: DecodeStep) -> list[Program]:
    out = []
    for b, (name, n, table) in enumerate(zip(step.names, step.context_lens, step.block_tables)):
        for g in range(num_kv_heads):
            for p in range(num_partitions):
                positions = range(p * PARTITION_SIZE, min((p + 1) * PARTITION_SIZE, n))
                blocks = list(dict.fromkeys(table[pos // BLOCK_SIZE] for pos in positions))
                out.append(Program(name, b, g, p, positions, blocks))
    return out


programs = programs_of(step)

# %% [markdown]
# ## Checks: the drawing's data against the block tables
#
# Each sequence's programs read exactly the blocks of its table that hold its context, each
# position once; no program reads a `-1` padding entry or a block of another sequence; both KV
# groups of a sequence read the same pages (each its own head's slice of them).

# %%
for b, (n, table) in enumerate(zip(step.context_lens, step.block_tables)):
    mine = [p for p in programs if p.row == b]
    owned = table[: -(-n // BLOCK_SIZE)]
    assert -1 not in owned and all(blk == -1 for blk in table[len(owned) :])
    for g in range(num_kv_heads):
        group = [p for p in mine if p.group == g]
        assert [pos for p in group for pos in p.positions] == list(range(n)), "each position once"
        assert list(dict.fromkeys(blk for p in group for blk in p.blocks)) == owned
    others = {blk for c, t in enumerate(step.block_tables) if c != b for blk in t if blk >= 0}
    assert not others & {blk for p in mine for blk in p.blocks}, "read another sequence's page"
assert all(-1 not in p.blocks for p in programs)
read = {blk for p in programs for blk in p.blocks}
print(
    f"{len(programs)} programs, {sum(bool(p.blocks) for p in programs)} read pages; "
    f"{len(read)} of {NUM_BLOCKS} blocks are read, each by the programs of one sequence"
)

# %% [markdown]
# ## The drawing
#
# Left: the block tables the kernel is given, one row per sequence, padded with `-1` (hatched:
# never dereferenced; the kernel masks every position at or past `context_lens[b]`). Right: one
# row per decode program `(sequence, KV group, partition)`, one column per physical block of the
# pool; a filled cell is a page the program reads, labelled with its logical index in the
# sequence (`n // block_size`). Rows with nothing filled are partitions past the context: those
# programs exit at once.

# %% tags=["hide-input"]
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7"]  # Okabe-Ito
colour = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(step.names)}
fig, (ax_t, ax_g) = plt.subplots(
    1,
    2,
    figsize=(13, 0.28 * len(programs) + 1.6),
    gridspec_kw={"width_ratios": [width, NUM_BLOCKS]},
)
for b, (name, table) in enumerate(zip(step.names, step.block_tables)):
    for j, blk in enumerate(table):
        pad = blk < 0
        face, hatch = ("white", "///") if pad else (colour[name], None)
        ax_t.add_patch(
            Rectangle((j, b), 1, 1, facecolor=face, hatch=hatch, edgecolor="0.6", lw=0.5)
        )
        ax_t.text(j + 0.5, b + 0.5, str(blk), ha="center", va="center", fontsize=8,
                  color="0.4" if pad else "white")  # fmt: skip
ax_t.set(xlim=(0, width), ylim=(len(step.names), 0), xticks=[j + 0.5 for j in range(width)],
         xticklabels=range(width), yticks=[b + 0.5 for b in range(len(step.names))],
         xlabel="table entry (logical block)", title="block_tables")  # fmt: skip
ax_t.set_yticklabels([f"{n} (ctx {c})" for n, c in zip(step.names, step.context_lens)])

for r, p in enumerate(programs):
    table = step.block_tables[p.row]
    for blk in p.blocks:
        ax_g.add_patch(Rectangle((blk, r), 1, 1, facecolor=colour[p.name], edgecolor="white"))
        ax_g.text(blk + 0.5, r + 0.5, str(table.index(blk)), ha="center", va="center",
                  fontsize=7, color="white")  # fmt: skip
    if not p.blocks:
        ax_g.text(0.3, r + 0.5, "exits at once (partition past the context)", va="center",
                  fontsize=7, color="0.5")  # fmt: skip
    if r and p.row != programs[r - 1].row:
        ax_g.axhline(r, color="0.3", lw=0.8)
ax_g.set(xlim=(0, NUM_BLOCKS), ylim=(len(programs), 0), xlabel="physical block of the pool",
         title=f"decode programs (b, g, p), partition_size {PARTITION_SIZE}")  # fmt: skip
ax_g.set_xticks(range(0, NUM_BLOCKS + 1, 5))
ax_g.set_yticks([r + 0.5 for r in range(len(programs))])
ax_g.set_yticklabels([f"{p.name} g{p.group} p{p.partition}" for p in programs], fontsize=7)
ax_g.grid(axis="x", color="0.92")
ax_g.set_axisbelow(True)
ax_g.legend(handles=[Patch(color=colour[n], label=n) for n in step.names]
            + [Patch(facecolor="white", hatch="///", edgecolor="0.6", label="-1: never read")],
            loc="lower right", fontsize=8)  # fmt: skip
fig.suptitle(f"decode step {step.step}: pages read in place through the block table")
fig.tight_layout()
if os.environ.get("NB06_PNG"):
    fig.savefig(os.environ["NB06_PNG"], dpi=110)
plt.show()

# %% [markdown]
# ## The kernel agrees: poison every page nobody reads
#
# Now the real decode kernel on this step's tables, with the partitions drawn above (`block_n`
# 16 divides 16), over a pool of random K/V where every block no program reads holds NaN. If any
# program read a page the drawing does not show, a NaN would reach its output. The result also
# matches the kernel with the split turned off (one partition).

# %%
gen = torch.Generator().manual_seed(0)
shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, 16)
k_cache, v_cache = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in "kv")
unread = [blk for blk in range(NUM_BLOCKS) if blk not in read]
k_cache[unread], v_cache[unread] = float("nan"), float("nan")
q = torch.randn(len(step.names), num_heads, 16, generator=gen, dtype=torch.float64)
lens = torch.tensor(step.context_lens, dtype=torch.int32)
tables = torch.tensor(step.block_tables, dtype=torch.int32)
split = paged_attention_decode(q, k_cache, v_cache, lens, tables, 0.25, partition_size=16,
                               block_n=16)  # fmt: skip
whole = paged_attention_decode(q, k_cache, v_cache, lens, tables, 0.25,
                               partition_size=num_partitions * 16, block_n=16)  # fmt: skip
assert torch.isfinite(split).all(), "a program read a page the drawing says nobody reads"
torch.testing.assert_close(split, whole)
print(
    f"{len(unread)} poisoned blocks, outputs finite; split-K = one partition, max diff "
    f"{(split - whole).abs().max():.1e}"
)
