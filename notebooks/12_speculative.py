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
# # Stage 12: guesses kept and rolled back, on the block table
#
# Stage 12's engine lets the n-gram proposer guess up to k tokens per sequence, checks every
# guess in one forward pass of the model, keeps the longest run the model agrees with, draws
# one token of its own after it, and rolls the rest back: the guesses were never part of the
# sequence (only the kept ones are appended), and the blocks reserved past what the sequence
# still needs go back to the pool.
#
# This notebook runs stage 12 on your CPU with a tiny random model and draws each verify step
# on the sequences' block tables: which positions were guesses, which were kept, which token the
# model drew, and which blocks were freed. Then it plots how many guesses each step kept.
#
# To run your own pieces, open `notebooks/12_speculative.py` in Jupyter (jupytext opens it as
# a notebook) and set `IMPL`. `pip install -e '.[notebooks]'` installs JupyterLab, jupytext and
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
import tempfile
from typing import NamedTuple

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from nanoserve import LLM, SamplingParams, grading
from nanoserve.testing import save_tiny_model

# What runs stage 12: "ref" (the reference in src/nanoserve), "starter" (the stage's
# starter.py), a path to your own .py file (absolute, or relative to this notebook's folder) or
# a dotted module name: the same values `pytest --impl` and `nanoserve check` accept. Its
# propose_ngram, num_accepted, residual and SpeculativeScheduler (make_room, land,
# settle_guesses) run inside the engine's one loop.
IMPL = "ref"

mine = grading.load_impl(12, IMPL)
components = {
    "SpeculativeScheduler": mine.SpeculativeScheduler,
    "propose_ngram": mine.propose_ngram,
    "num_accepted": mine.num_accepted,
    "residual": mine.residual,
}
print(f"stage 12's lookup, rule and scheduler from {IMPL!r}")

# %% [markdown]
# ## Three requests, step by step
#
# A tiny random Llama (two layers, float64), block size 4, a pool of 32 blocks, up to
# `num_speculative_tokens = 4` guesses per sequence and step (three sequences at once guess
# nothing by default: `GUESSES_BY_BATCH` guesses only for a sequence alone), greedy, 16 tokens
# each: the run the stage page traces. Two prompts repeat themselves, so the n-gram proposer
# finds something to copy; the third does not. A random model soon repeats itself too, and
# then the guesses start to be right.
#
# A verify step is launched while the step before it still runs, and its verdict reaches the
# host with the next step. The engine calls `on_step` once per step with a `StepRecord`
# (`engine/loop/trace.py`), after the step was launched and *before* `update`; its `verdicts`
# are the verify steps whose verdict came back with it (per sequence, what it guessed and what
# it gained: the kept guesses and the drawn token). At that moment each sequence holds only its
# tokens from before the verify step (a guess is never in `token_ids`) and the blocks reserved
# for the guesses of both steps; after `step()` returns, its table is what `settle_guesses`
# left: what the step still in flight writes.


# %%
class SeqStep(NamedTuple):
    """One sequence in one verify step."""

    seq_id: int
    length: int  # L: tokens before the step; the newest, at L - 1, is fed with the guesses
    guesses: list[int]
    gained: list[int]  # kept guesses, then the token the target drew
    table_before: list[int]  # with the room reserved for the guesses (its step's and the next's)
    table_after: list[int]  # what the rollback left ([] once the sequence finished)
    finished: bool
    keeps: int  # the tokens' room the rollback must keep (what the step in flight writes)

    @property
    def num_kept(self) -> int:
        return len(self.gained) - 1


folder = save_tiny_model(tempfile.mkdtemp(prefix="nanoserve-nb12-"), "llama")
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7, 5], [9, 8, 7, 6, 5, 4, 3]]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float64", block_size=4, num_kv_blocks=32, max_model_len=64)

llm = LLM(folder, stage=12, num_speculative_tokens=4, components=components, **ENGINE)
engine = llm.engine
seqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
launched: dict[int, int] = {}  # id(plan) -> the engine step that launched it (plans that guess)
arrived: list[tuple] = []  # verdicts that came back in the current call, before their rollback


def on_step(record) -> None:
    if any(record.batch.guesses):
        launched[id(record.batch)] = record.step
    # the step just launched is in flight: what it writes for each sequence stays
    in_flight = dict(zip(record.batch.seqs, record.batch.guesses or [0] * len(record.batch.seqs)))
    for verdict in record.verdicts:
        for seq, guessed, gained in zip(verdict.plan.seqs, verdict.guesses, verdict.tokens):
            length = len(seq.token_ids)  # the owed token is not appended yet
            if seq in in_flight:  # it writes seq's newest token, then its own guesses
                keeps = length + len(gained) + in_flight[seq]
            else:  # only the stored K/V: the newest token and the kept guesses
                keeps = length + len(gained) - 1
            before = list(seq.block_table)
            arrived.append(
                (launched[id(verdict.plan)], seq, length, guessed, gained, before, keeps)
            )


engine.on_step = on_step
by_step: dict[int, list[SeqStep]] = {}  # verify step -> its sequences, once its verdict landed
while engine.has_unfinished():
    arrived.clear()
    engine.step()
    for step, s, n, g, gain, before, keeps in arrived:
        after = list(s.block_table)
        by_step.setdefault(step, []).append(SeqStep(s.seq_id, n, g, gain, before, after,
                                                    s.is_finished, keeps))  # fmt: skip
steps = sorted(by_step.items())  # (engine step, its sequences), verify steps only
stats = engine.speculation
assert sum(len(s.guesses) for _, q in steps for s in q) == stats.num_proposed, "a verdict unseen"
num_plain = engine.num_steps - len(steps)
print(f"{engine.num_steps} steps: {len(steps)} verify, {num_plain} plain (prefill and decode)")
print(
    f"{stats.num_proposed} guesses, {stats.num_accepted} kept: acceptance "
    f"{stats.acceptance_rate:.2f}, {stats.tokens_per_step:.2f} tokens per verified sequence-step"
)
print(f"free blocks at the end: {engine.manager.num_free_blocks} of 32")

# %% [markdown]
# The same prompts on stage 11, which never guesses: the greedy tokens must be identical, and
# stage 12 can take no more steps. It takes fewer only when *every* sequence of the batch gains:
# the batch runs until its slowest request is done, and the third prompt finds little to copy.

# %%
llm_11 = LLM(folder, stage=11, **ENGINE)
out_11 = llm_11.generate(PROMPTS, PARAMS, use_tqdm=False)
assert [s.completion_token_ids for s in seqs] == [o.token_ids for o in out_11]
assert engine.num_steps <= llm_11.engine.num_steps
assert engine.manager.num_free_blocks == 32, "every block is free after the last request"
print(f"greedy tokens identical to stage 11's; stage 11 took {llm_11.engine.num_steps} steps")

# %% [markdown]
# ## Each verify step, drawn on the block tables
#
# One panel per verify step, one lane per sequence that guessed (a sequence with no guess rides
# along in the same forward as one row, as in a decode step). A lane has two rows of cells, one per
# position, grouped by block (the block's id above it):
#
# - **fed** (upper row): what the verify step computed, the newest token `t` and the guesses,
#   green where the target kept the guess and vermillion where it rejected it (every guess
#   after the first rejection is thrown away, right or not);
# - **after** (lower row): the sequence after `update`: its stored tokens (grey), the kept
#   guesses (green) and the token the target drew (blue), the one the next step feeds.
#
# A block reserved for the guesses and given back by `settle_guesses` is hatched. Numbers in
# the cells are token ids. (The drawing code, plain matplotlib, is in the next cell of the
# notebook; the docs site hides it.)

# %% tags=["hide-input"]
# Okabe-Ito colours, distinguishable with the common colour-vision deficiencies.
COLOURS = {
    "stored": "#D9D9D9",
    "fed": "#999999",
    "kept": "#009E73",
    "rejected": "#D55E00",
    "drawn": "#0072B2",
}
BLOCK = 4
GAP = 0.35  # space between two blocks, in cells


def x_of(position: int) -> float:
    """The left edge of a position's cell: blocks of 4 cells, a small gap between blocks."""
    return position + (position // BLOCK) * GAP


def cell(ax, position: int, y: float, colour: str, text: str, hatch: str | None = None) -> None:
    ax.add_patch(Rectangle((x_of(position), y), 0.92, 0.42, facecolor=colour,
                           edgecolor="white", hatch=hatch, linewidth=0.5))  # fmt: skip
    ax.text(x_of(position) + 0.46, y + 0.21, text, ha="center", va="center", fontsize=6,
            color="black" if colour == COLOURS["stored"] else "white")  # fmt: skip


def draw_lane(ax, s: SeqStep, y: float, tokens: list[int]) -> None:
    """One sequence: blocks with ids, the fed row above, the after row below."""
    first = s.length - 1  # the newest token, fed again with the guesses
    kept = s.num_kept
    fed = [tokens[first], *s.guesses]
    for i, token_id in enumerate(fed):
        colour = COLOURS["fed"] if i == 0 else COLOURS["kept" if i <= kept else "rejected"]
        cell(ax, first + i, y + 0.5, colour, str(token_id))
    after = tokens[: s.length] + s.gained
    for p, token_id in enumerate(after):
        if p < s.length:
            colour = COLOURS["stored"]
        else:
            colour = COLOURS["drawn" if p == len(after) - 1 else "kept"]
        cell(ax, p, y, colour, str(token_id))
    freed = [] if s.finished else s.table_before[len(s.table_after) :]
    for i, block_id in enumerate(s.table_before):
        x = x_of(i * BLOCK)
        label = f"{block_id}" + (" freed" if block_id in freed else "")
        ax.text(x, y + 1.0, label, fontsize=6, va="bottom",
                color=COLOURS["rejected"] if block_id in freed else "#555555")  # fmt: skip
        if block_id in freed:
            ax.add_patch(Rectangle((x - 0.05, y - 0.05), BLOCK + 0.02, 1.0, fill=False,
                                   hatch="///", edgecolor=COLOURS["rejected"],
                                   linewidth=0))  # fmt: skip
    status = "finished" if s.finished else f"kept {kept} of {len(s.guesses)}"
    ax.text(-0.6, y + 0.45, f"seq {s.seq_id}\n{status}", ha="right", va="center", fontsize=7)


def draw_steps(steps, tokens_of: dict[int, list[int]], max_steps: int = 6) -> None:
    """One panel per verify step (the first max_steps), one lane per sequence that guessed."""
    shown = [(step, [s for s in q if s.guesses]) for step, q in steps[:max_steps]]
    width = max(x_of(len(s.table_before) * BLOCK) for _, seqs in shown for s in seqs)
    lanes = [len(q) for _, q in shown]
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 0.5 + 1.3 * sum(lanes)), squeeze=False,
                             layout="constrained", height_ratios=lanes)  # fmt: skip
    for ax, (step, step_seqs) in zip(axes[:, 0], shown):
        for lane, s in enumerate(step_seqs):
            draw_lane(ax, s, -1.5 * lane, tokens_of[s.seq_id])
        ax.set_xlim(-0.2, width + 0.2)
        ax.set_ylim(-1.5 * len(step_seqs) + 0.9, 1.35)
        ax.set_title(f"step {step} (verify)", loc="left", fontsize=9)
        ax.axis("off")
    handles = [Patch(color=COLOURS[k], label=k) for k in COLOURS]
    handles.append(Patch(facecolor="white", edgecolor=COLOURS["rejected"], hatch="///",
                         label="block freed by the rollback"))  # fmt: skip
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    plt.show()


# %%
# token ids as each sequence ended: positions below a verify step's L are the same at that step
tokens_of = {s.seq_id: s.token_ids for s in seqs}
draw_steps(steps, tokens_of)

# %% [markdown]
# What to look for:
#
# - **A rejection cuts the run.** Everything right of the first vermillion cell is thrown
#   away, and the after row ends with the target's own token (blue) in the place of the first
#   rejected guess.
# - **A freed block.** The table before the rollback holds room for the guesses of this step
#   and of the step launched after it (scheduled as if every guess of this one were kept). The
#   blocks past what that next step writes go back (hatched); a step that needs one again grows
#   the table, usually with the same id (the free list is last in, first out).
# - **The blue token is never stored yet.** The after row's last cell is the token the next step
#   feeds. That step is already running when the verdict lands, so its block stays, with room for
#   its own guesses; a sequence the next step does not run keeps only its stored tokens.
#
# ## Acceptance per step
#
# Left: for every verify step, how many guesses were judged (all sequences together), how many
# were kept, and what the step gained: kept guesses plus one drawn token per sequence. A decode
# step of stage 11 gains exactly one token per sequence (dashed). Right: the acceptance rate,
# kept guesses per guess, at each verify step and over the run so far (what
# `engine.speculation.acceptance_rate` reports at the end).

# %% tags=["hide-input"]
labels = [str(step) for step, _ in steps]
proposed = [sum(len(s.guesses) for s in q) for _, q in steps]
kept = [sum(s.num_kept for s in q) for _, q in steps]
gained = [sum(len(s.gained) for s in q) for _, q in steps]
num_seqs = [len(q) for _, q in steps]
rate = [k / n if n else 0.0 for k, n in zip(kept, proposed)]
so_far = [sum(kept[: i + 1]) / max(1, sum(proposed[: i + 1])) for i in range(len(steps))]
fig, (ax, ax_rate) = plt.subplots(1, 2, figsize=(11, 3.4), layout="constrained",
                                  width_ratios=[3, 2])  # fmt: skip
xs = range(len(steps))
ax.bar(xs, proposed, color=COLOURS["rejected"], label="guesses rejected")
ax.bar(xs, kept, color=COLOURS["kept"], label="guesses kept")
ax.plot(xs, gained, "o-", color=COLOURS["drawn"], label="tokens gained")
ax.plot(xs, num_seqs, "--", color="#555555", label="a decode step's gain")
ax.set_ylim(0, max(proposed + gained) * 1.35)
ax.set_ylabel("tokens")
ax_rate.bar(xs, rate, color=COLOURS["kept"], label="this step")
ax_rate.plot(xs, so_far, "o-", color="#555555", label="so far")
ax_rate.set_ylim(0, 1.3)
ax_rate.set_ylabel("acceptance rate")
for a in (ax, ax_rate):
    a.set_xticks(list(xs), labels)
    a.set_xlabel("engine step (verify steps only)")
    a.legend(frameon=False, fontsize=8, loc="upper center", ncol=2)
    for side in ("top", "right"):
        a.spines[side].set_visible(False)
plt.show()

# %% [markdown]
# ## What must be true
#
# At every verify step the rollback keeps exactly the blocks the sequence still needs and gives
# back the rest: when the step launched after it runs the sequence, what that step writes
# (`L + gained`, the drawn token included, plus its own budget); otherwise the stored tokens
# (`L + kept`). A guess is only ever kept in a leading run.

# %%
for step, step_seqs in steps:
    for s in step_seqs:
        assert s.gained[:-1] == s.guesses[: s.num_kept], f"step {step}: kept a non-leading guess"
        if not s.finished:
            blocks = -(-s.keeps // BLOCK)
            assert len(s.table_after) == blocks, f"step {step}: room for {s.keeps} tokens"
            assert s.table_after == s.table_before[: len(s.table_after)]
print(f"{len(steps)} verify steps: every rollback kept just the room still written")

# %% [markdown]
# ## What it buys on a GPU
#
# This notebook's model is tiny and runs on a CPU, where a kept guess is nearly a free token. On
# the H200 (SmolLM2-135M, the repeat workload, 256 tokens per request; three interleaved rounds
# per cell, `tools/sweep_speculation.py`; every run in `docs/benchmarks.md`, "Stage 12 by batch
# size"), stage 12 against stage 11, greedy:
#
# | requests at once | 2 guesses | 4 guesses | 8 guesses |
# |---:|---:|---:|---:|
# | 1 | 1.12x | **1.18x** | 1.16x |
# | 4 | 1.02x | 1.04x | 1.08x |
# | 16 | 0.88x | 0.83x | – |
# | 64 | 0.66x | 0.69x | – |
#
# A verify step then cost about one and a half plain steps (the lookup, the picking and the
# verdict were small launches around the graph replay), and a batch waits for its slowest
# request, so guessing paid only for a sequence alone: that is `GUESSES_BY_BATCH`. Since then the
# verify step is one graph replay (1.07x a plain step alone): alone, stage 12 ran 1.13x (2
# guesses) and 1.16x (4), one round each; the wider batches are not re-measured yet.
