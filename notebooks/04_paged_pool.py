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
# # Stage 04: the paged pool, step by step
#
# Stage 04 allocates one KV pool, `[2, L, N, block_size, H_kv, D]`, once, and from then on only
# block **ids** move: the block manager hands them to sequences one page at a time, takes them
# back when a sequence finishes or is preempted, and hands them to the next sequence.
#
# This notebook runs the **live** stage-04 engine on a tiny random model. The engine reports
# every step it runs to a callback, `engine.on_step`, as a `StepRecord`: the batch it scheduled
# (which sequences, prefill or decode), the inputs the cache prepared for the model (`slot_mapping`,
# `block_tables`, ...) and how many sequences it preempted while scheduling. From those records
# the notebook draws the pool as a steps x blocks map, coloured by the request holding each block.
# Nothing is scripted or guessed: if you plug in your own pieces (next cell), it draws your code.
# The docs site shows this notebook as the reference engine draws it, run when the site was
# built; to draw yours, open `notebooks/04_paged_pool.py` in Jupyter (jupytext opens it as a
# notebook) and set `IMPL`. `pip install -e '.[notebooks]'` installs JupyterLab, jupytext and
# matplotlib; then `jupyter lab notebooks/` and, on the file, *Open With -> Jupytext Notebook*.

# %% tags=["hide-input"]
# Progress bars (saving the tiny checkpoint draws one) are only noise on a rendered page, and
# tqdm warns at import when the kernel has no ipywidgets.
import os
import warnings

os.environ["TQDM_DISABLE"] = "1"
warnings.filterwarnings("ignore", message="IProgress not found")

# Figures at twice the pixels, shown at their own size: sharp on high-density screens.
# %config InlineBackend.figure_format = "retina"

# %%
import itertools
import random
import tempfile
from typing import NamedTuple

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import patheffects
from matplotlib.colors import to_rgb
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from nanoserve import LLM, SamplingParams, grading
from nanoserve.engine.loop.trace import StepRecord
from nanoserve.testing import save_tiny_model

# What to run: "ref" (the reference in src/nanoserve), "starter" (the stage's starter.py), a path
# to your own .py file (absolute, or relative to this notebook's folder) or a dotted module name:
# the same values `pytest --impl` and `nanoserve check` accept. All five stage-04 pieces
# (BlockManager, store_kvcache, gather_kv, prepare_prefill, prepare_decode) come from it.
IMPL = "ref"

components = vars(grading.load_impl(4, IMPL))
print(f"stage-04 pieces from {IMPL!r}: {', '.join(components)}")

# %% [markdown]
# ## A tiny random model
#
# Two layers, 4 query heads, 2 KV heads of dimension 16, random weights, saved the way a real
# checkpoint is and loaded by nanoserve's own loader. float64, so that two runs doing the same
# arithmetic must agree token for token.

# %%
folder = save_tiny_model(tempfile.mkdtemp(prefix="nanoserve-nb04-"), "llama")

BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 4, 24, 64


def paged_llm(num_kv_blocks):
    """The stage-04 engine on the tiny model, with your pieces plugged in."""
    return LLM(
        folder,
        stage=4,
        device="cpu",
        dtype="float64",
        components=components,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        max_model_len=MAX_MODEL_LEN,
    )


llm = paged_llm(NUM_BLOCKS)
engine = llm.engine
pool = engine.runner.cache.kv
print(f"pool tensor {list(pool.shape)}  = [K/V, layers, blocks, block_size, kv heads, head dim]")
print(f"{NUM_BLOCKS} blocks x {BLOCK_SIZE} tokens = {NUM_BLOCKS * BLOCK_SIZE} token slots in all")

# %% [markdown]
# ## The workload
#
# Four requests arrive at once; two more arrive later, while the first ones are decoding
# (continuous batching: a newcomer does not wait for the batch to drain). Every request runs to
# its `max_tokens` (`ignore_eos`). At their longest, A to D need 10 + 8 + 8 + 6 = 32 blocks, more
# than the 24 there are, so the pool must run dry somewhere and the scheduler must preempt.

# %%
rng = random.Random(0)
WORKLOAD = {  # name: (arrives before step, prompt length, max_tokens)
    "A": (1, 10, 30),
    "B": (1, 6, 26),
    "C": (1, 14, 18),
    "D": (1, 3, 20),
    "E": (8, 9, 8),
    "F": (14, 5, 12),
}
PROMPTS = {name: [rng.randrange(256) for _ in range(n)] for name, (_, n, _) in WORKLOAD.items()}
for name, (arrival, prompt_len, max_tokens) in WORKLOAD.items():
    longest = prompt_len + max_tokens
    print(
        f"{name}: arrives before step {arrival:2d}, prompt {prompt_len:2d}, max_tokens "
        f"{max_tokens:2d} -> at most {longest} tokens = {-(-longest // BLOCK_SIZE)} blocks"
    )

# %% [markdown]
# ## Recording every step
#
# The engine calls `on_step(record)` once per step, after the model ran and before the requests
# that finished in it let go of their blocks. So a record shows the pool *during* the step: what
# the scheduler had just decided (new blocks, preemptions) and what the model read and wrote.
#
# `Sequence` objects keep changing after the step, so the callback copies what the pictures need
# into a `Snapshot`: which blocks every running request holds (the sequences the step ran and
# the ones that sat it out), which blocks the step wrote K/V into (`slot_mapping // block_size`),
# and the record's own facts: step number, prefill or decode, the batch, `num_preempted`.


# %%
class Snapshot(NamedTuple):
    """The pool during one step, copied out of the engine's StepRecord."""

    step: int
    is_prefill: bool
    ran: list[str]  # the batch's requests, in batch order
    num_new_tokens: dict[str, int]  # request -> tokens computed for it in this step
    num_preempted: int  # preempted while scheduling this step
    owner: dict[int, str]  # block id -> request holding it
    written: set[int]  # blocks that received K/V in this step
    num_free: int


NAMES: dict[int, str] = {}  # seq_id -> request name
SEQS = {}  # request name -> its Sequence
snapshots: list[Snapshot] = []
finished_at: dict[str, int] = {}  # request -> the step it finished in


def on_step(record: StepRecord) -> None:
    """Copy one step out of the engine's record before the sequences move on."""
    md = record.inputs.metadata
    q = md.host.cu_seqlens_q  # sequence i computed q[i + 1] - q[i] new tokens
    slots = [s for s in md.slot_mapping.tolist() if s >= 0]
    running = engine.scheduler.running  # holders of blocks: the batch and, in a prefill, the rest
    snapshots.append(
        Snapshot(
            step=record.step,
            is_prefill=record.batch.is_prefill,
            ran=[NAMES[seq.seq_id] for seq in record.batch.seqs],
            num_new_tokens={
                NAMES[seq.seq_id]: q[i + 1] - q[i] for i, seq in enumerate(record.batch.seqs)
            },
            num_preempted=record.num_preempted,
            owner={b: NAMES[seq.seq_id] for seq in running for b in seq.block_table},
            written={slot // BLOCK_SIZE for slot in slots},
            num_free=engine.manager.num_free_blocks,
        )
    )


def arrive(step: int) -> None:
    """Queue the requests that arrive before this step."""
    for name, (arrival, _, max_tokens) in WORKLOAD.items():
        if arrival == step:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            seq = engine.add_request(PROMPTS[name], params)
            NAMES[seq.seq_id], SEQS[name] = name, seq


engine.on_step = on_step
arrive(1)
while engine.has_unfinished():
    for seq in engine.step():
        finished_at[NAMES[seq.seq_id]] = engine.num_steps
    engine.manager.check_invariants()
    arrive(engine.num_steps + 1)
assert set(SEQS) == set(WORKLOAD), "the engine ran dry before every request had arrived"
print(f"{len(snapshots)} steps recorded")

# %% [markdown]
# ## Preemptions and frees, from consecutive records
#
# A record says *how many* sequences were preempted while scheduling its step; which ones it
# was follows from two consecutive snapshots: a request that held blocks in step `s - 1`,
# holds none in step `s` and did not finish in step `s - 1` lost them to preemption. Frees on
# finish come from `engine.step()`, which returns the requests that finished in it; their blocks
# go back to the free list before the next step is scheduled.


# %%
def held(snapshot: Snapshot, name: str) -> list[int]:
    """The blocks one request holds during a step."""
    return sorted(b for b, n in snapshot.owner.items() if n == name)


preempted_at: dict[int, list[str]] = {}  # step -> requests preempted while scheduling it
for before, now in itertools.pairwise(snapshots):
    lost = {n for n in before.owner.values() if n not in now.owner.values()}
    preempted_at[now.step] = sorted(n for n in lost if finished_at.get(n) != before.step)
    assert len(preempted_at[now.step]) == now.num_preempted, f"step {now.step}"
assert sum(s.num_preempted for s in snapshots) == engine.scheduler.num_preemptions

# %% [markdown]
# ## The pool, step by step
#
# One row per step, one column per physical block, coloured by the request holding the block
# during that step. A full colour means the request ran in the step; a pale one means it held
# its blocks but sat the step out (a prefill step runs only the requests it admits). A dot marks
# a block that received K/V in the step: every block of an admitted prompt in a prefill, one
# block per request in a decode. A mark in a request's last row on its blocks says how it let go
# of them: `x` preempted (the blocks were taken back while the next step was scheduled, and the
# request will be prefilled again), a circle finished (the blocks went back after the step). The
# bars on the right count the free blocks. (The drawing code, plain matplotlib, is in the next
# cell of the notebook; the docs site hides it.)

# %% tags=["hide-input"]
# Okabe-Ito colours, distinguishable with the common colour-vision deficiencies.
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#F0E442", "#56B4E9", "#D55E00"]
REQUEST_COLOUR = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(WORKLOAD)}
FREE_COLOUR = "#f2f2f2"
HALO = [patheffects.withStroke(linewidth=3, foreground="white")]  # marks stay visible on dark
MARK_STYLES = {  # plot() keywords, shared by the marks and their legend entries
    "written": {"marker": ".", "markersize": 6, "label": "K/V written in this step"},
    "preempted": {
        "marker": "x",
        "markersize": 9,
        "markeredgewidth": 2.2,
        "label": "preempted: blocks taken back before the next step",
    },
    "finished": {
        "marker": "o",
        "markersize": 9,
        "markeredgewidth": 1.6,
        "markerfacecolor": "none",
        "label": "finished: blocks returned after this step",
    },
}
plt.rcParams["figure.dpi"] = 100


def pale(rgb: np.ndarray) -> np.ndarray:
    """A colour washed toward white: the holder sat this step out."""
    return 0.25 * rgb + 0.75


def occupancy_image(snapshots: list[Snapshot]) -> np.ndarray:
    """(steps, blocks, RGB): the holder's colour, paled where it did not run in the step."""
    image = np.empty((len(snapshots), NUM_BLOCKS, 3))
    for row, snap in enumerate(snapshots):
        for block in range(NUM_BLOCKS):
            name = snap.owner.get(block)
            if name is None:
                image[row, block] = to_rgb(FREE_COLOUR)
                continue
            rgb = np.array(to_rgb(REQUEST_COLOUR[name]))
            image[row, block] = rgb if name in snap.ran else pale(rgb)
    return image


def mark_cells(snapshots: list[Snapshot]) -> dict[str, list[tuple[int, int]]]:
    """(row, block) cells to mark: K/V written, and blocks let go by preemption or finishing."""
    cells = {"written": [], "preempted": [], "finished": []}
    for row, snap in enumerate(snapshots):
        cells["written"] += [(row, b) for b in snap.written]
        for name in preempted_at.get(snap.step + 1, []):
            cells["preempted"] += [(row, b) for b in held(snap, name)]
        for name in (n for n, step in finished_at.items() if step == snap.step):
            cells["finished"] += [(row, b) for b in held(snap, name)]
    return cells


def step_label(snap: Snapshot) -> str:
    """`13 decode  ABCD`: the step, its kind and its batch, for the y axis."""
    kind = "prefill" if snap.is_prefill else "decode"
    return f"{snap.step:2d} {kind:<7} {''.join(snap.ran):<5}"


def draw_pool_map(ax, snapshots: list[Snapshot]) -> None:
    """One row per step, one column per block, with the marks on top."""
    num_steps = len(snapshots)
    ax.imshow(occupancy_image(snapshots), aspect="auto", interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, NUM_BLOCKS), minor=True)
    ax.set_yticks(np.arange(-0.5, num_steps), minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks(range(NUM_BLOCKS))
    ax.set_yticks(range(num_steps), [step_label(s) for s in snapshots], family="monospace")
    ax.tick_params(axis="y", labelsize=8)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("physical block id")
    ax.text(-0.7, -0.9, "step kind    ran", family="monospace", fontsize=8, ha="right")
    for kind, cells in mark_cells(snapshots).items():
        if cells:
            rows, cols = zip(*cells)
            ax.plot(cols, rows, linestyle="", color="black", path_effects=HALO, **MARK_STYLES[kind])


def draw_free_counts(ax, snapshots: list[Snapshot]) -> None:
    """The free blocks during each step, as bars beside the map."""
    counts = [s.num_free for s in snapshots]
    ax.barh(range(len(counts)), counts, color="#999999", height=0.7)
    for row, count in enumerate(counts):
        ax.text(count + 0.4, row, str(count), va="center", fontsize=7)
    ax.set_xlim(0, NUM_BLOCKS)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("free blocks")
    ax.tick_params(axis="y", length=0)
    for side in ("right", "bottom"):
        ax.spines[side].set_visible(False)


def draw_occupancy(snapshots: list[Snapshot]) -> None:
    """The steps x blocks map and the free counts, with one legend under both."""
    fig, (ax, ax_free) = plt.subplots(
        1,
        2,
        figsize=(10.5, 0.25 * len(snapshots) + 2.2),
        sharey=True,
        layout="constrained",
        gridspec_kw={"width_ratios": [NUM_BLOCKS, 5]},
    )
    draw_pool_map(ax, snapshots)
    draw_free_counts(ax_free, snapshots)
    handles = [Patch(color=REQUEST_COLOUR[n], label=f"request {n}") for n in WORKLOAD]
    handles.append(Patch(facecolor=FREE_COLOUR, edgecolor="#cccccc", label="free block"))
    handles.append(
        Patch(
            facecolor=pale(np.array(to_rgb(COLOURS[0]))),
            label="pale: holds blocks, sat the step out",
        )
    )
    handles += [Line2D([], [], linestyle="", color="black", **st) for st in MARK_STYLES.values()]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=9, frameon=False)
    plt.show()


# %%
draw_occupancy(snapshots)

# %% [markdown]
# ## The same run as text
#
# One line per step: the kind, who ran, the pool during the step as one character per block
# (a request's letter, or `.` when free), the free count, and what happened to memory. `+n`
# counts blocks a request took in the step; a reuse names the finished request whose block it
# took.


# %%
def pool_row(owner: dict[int, str]) -> str:
    """The pool as one character per block, grouped by eight."""
    cells = "".join(owner.get(b, ".") for b in range(NUM_BLOCKS))
    return " ".join(cells[i : i + 8] for i in range(0, NUM_BLOCKS, 8))


last_holder: dict[int, str] = {}  # block id -> the last request seen holding it
reuses_after_finish = []  # (step, block, old holder, new holder)
preempted_events = []  # (step, request name)
free_counts = []  # free blocks during each step
previous: dict[int, str] = {}
for snap in snapshots:
    events = []
    for name in preempted_at.get(snap.step, []):
        preempted_events.append((snap.step, name))
        lost = sum(1 for n in previous.values() if n == name)
        events.append(f"preempt {name} (-{lost})")
    if snap.is_prefill:
        again = [n for n in snap.ran if any(n == name for _, name in preempted_events)]
        events += [f"{n} recomputes {snap.num_new_tokens[n]} tokens" for n in again]
    taken: dict[str, list[int]] = {}
    for block, name in sorted(snap.owner.items()):
        if previous.get(block) != name:
            taken.setdefault(name, []).append(block)
            old = last_holder.get(block)
            if old is not None and finished_at[old] < snap.step:
                reuses_after_finish.append((snap.step, block, old, name))
    for name, blocks in taken.items():
        reused = [f"{b} from {last_holder[b]}" for b in blocks if b in last_holder]
        events.append(f"{name}+{len(blocks)}" + (f" ({', '.join(reused)})" if reused else ""))
    for name, step in finished_at.items():
        if step == snap.step:
            events.append(f"finish {name} (-{len(held(snap, name))})")
    last_holder.update(snap.owner)
    free_counts.append(snap.num_free)
    kind = "prefill" if snap.is_prefill else "decode"
    print(
        f"{snap.step:2d} {kind:<7} {''.join(snap.ran):<6}|{pool_row(snap.owner)}| "
        f"free {snap.num_free:2d}  " + ", ".join(events)
    )
    previous = {b: n for b, n in snap.owner.items() if finished_at.get(n) != snap.step}

# %% [markdown]
# Things to find in the trace above:
#
# - **Lazy growth.** A decode step adds one block to a request only when its new token is the
#   first of a page (its length is `1 mod 4` before the step); most steps change nothing.
# - **Preemption by recompute.** When a running request needs a block and none is free, the
#   *newest* running request loses all its blocks and goes back to the front of the queue. Its
#   K/V is not copied anywhere; when blocks free up, its prompt *and* the tokens it had already
#   generated are prefilled again.
# - **Reuse.** A finished request's blocks go straight back to the free list; the next allocation
#   takes them, in whatever order the free list hands them out. A block id means nothing on its
#   own: what it holds is decided by whoever holds it now.
#
# With the reference pieces the story runs like this: the four first requests fit at once; E
# arrives at step 8 and is admitted straight into the running batch. By step 13 the pool is
# empty and A needs a block, so E, the newest, is preempted and its blocks go to C, B and A. D
# follows at step 17. F arrives at step 14 but waits behind E (the queue is first come, first
# served) until C finishes at step 19; step 20 then prefills D, E and F together on C's and D's
# old blocks, E and D recomputing the tokens they had generated before.

# %% [markdown]
# ## What must be true at the end
#
# Nothing leaked; memory really was short (preemptions happened, and the pool touched empty);
# finished requests' blocks were reused; every request got all its tokens.

# %%
num_preemptions = engine.scheduler.num_preemptions
print(f"steps {step}, preemptions {num_preemptions}, lowest free count {min(free_counts)}")
print(f"first reuses after a finish: {reuses_after_finish[:3]}")
assert engine.manager.num_free_blocks == NUM_BLOCKS, "blocks leaked"
assert num_preemptions >= 1 and preempted_events
assert min(free_counts) == 0, "the pool never ran dry"
assert reuses_after_finish, "no block was reused after a finish"
assert all(SEQS[n].num_completion_tokens == WORKLOAD[n][2] for n in WORKLOAD)

# %% [markdown]
# ## Preemption lost nothing
#
# Run the same prompts on a pool large enough that nothing is ever preempted. Every request's
# tokens must be identical: recompute rebuilds exactly the K/V it threw away.

# %%
big = paged_llm(num_kv_blocks=1000)
params = [SamplingParams(max_tokens=WORKLOAD[n][2], ignore_eos=True) for n in WORKLOAD]
outputs = big.generate([PROMPTS[n] for n in WORKLOAD], params, use_tqdm=False)
for name, out in zip(WORKLOAD, outputs):
    same = out.token_ids == SEQS[name].completion_token_ids
    print(f"{name}: {len(out.token_ids)} tokens, identical: {same}")
    assert same
assert big.engine.scheduler.num_preemptions == 0
