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
# This notebook runs the **live** stage-04 engine on a tiny random model and, after every
# `engine.step()`, draws the pool as one character per block: the letter of the request that
# holds it, or `.` when it is free. Nothing is scripted: the pictures are read from each running
# sequence's `block_table`, so if you plug in your own pieces (next cell), they draw your code.

# %%
import random
import tempfile

import torch


from nanoserve import LLM, SamplingParams, grading
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
# ## Drawing the pool
#
# One character per physical block, in block-id order, in groups of eight:
# `AAAB BB..` means blocks 0-2 belong to A, 3-5 to B, 6-7 are free.


# %%
def owners(engine) -> dict[int, str]:
    """block id -> the name of the running request that holds it."""
    return {b: NAMES[seq.seq_id] for seq in engine.scheduler.running for b in seq.block_table}


def pool_row(owner: dict[int, str]) -> str:
    """The pool as one character per block, grouped by eight."""
    cells = "".join(owner.get(b, ".") for b in range(NUM_BLOCKS))
    return " ".join(cells[i : i + 8] for i in range(0, NUM_BLOCKS, 8))


def tables(engine) -> str:
    """Each running request's length and block table."""
    rows = [
        f"    {NAMES[s.seq_id]}  len {len(s):2d}  blocks {s.block_table}"
        for s in engine.scheduler.running
    ]
    return "\n".join(rows)


# %% [markdown]
# ## Running it
#
# Each line is one step: what kind of step it was and which requests ran in it, the pool after
# the step, the free count, and what happened to memory. Below a line, `tables` shows the block
# tables at the moments worth looking at: the first prefill, each preemption, the first reuse.

# %%
NAMES: dict[int, str] = {}  # seq_id -> request name
SEQS = {}  # request name -> its Sequence
last_holder: dict[int, str] = {}  # block id -> the last request seen holding it
finished_names: set[str] = set()
reuses_after_finish = []  # (step, block, old holder, new holder)
preempted_events = []  # (step, request name)
free_counts = []  # free blocks after each step


def arrive(step: int) -> None:
    """Queue the requests whose arrival is this step."""
    for name, (arrival, _, max_tokens) in WORKLOAD.items():
        if arrival == step:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            seq = engine.add_request(PROMPTS[name], params)
            NAMES[seq.seq_id], SEQS[name] = name, seq


def gains(step: int, before: dict[int, str], now: dict[int, str]) -> list[str]:
    """Blocks each request took this step, and whose they were last (if anyone's)."""
    taken: dict[str, dict[str, list[int]]] = {}  # new holder -> {old holder or "": blocks}
    for block, name in sorted(now.items()):
        if before.get(block) != name:
            old = last_holder.get(block, "")
            taken.setdefault(name, {}).setdefault(old, []).append(block)
            if old in finished_names:
                reuses_after_finish.append((step, block, old, name))
    events = []
    for name, by_old in taken.items():
        reused = [f"{' '.join(map(str, bs))} from {old}" for old, bs in by_old.items() if old]
        count = sum(len(bs) for bs in by_old.values())
        events.append(f"{name}+{count}" + (f" ({'; '.join(reused)})" if reused else ""))
    return events


def run_step(step: int) -> None:
    """One engine step, then its line: kind, who ran, the pool, free blocks, memory events."""
    before = owners(engine)
    lengths = {name: len(seq) for name, seq in SEQS.items()}
    preemptions = {name: seq.num_preemptions for name, seq in SEQS.items()}

    finished = engine.step()
    engine.manager.check_invariants()

    ran = [name for name, seq in SEQS.items() if len(seq) > lengths[name]]
    held_before = {name: sum(1 for n in before.values() if n == name) for name in SEQS}
    kind = "prefill" if any(held_before[n] == 0 for n in ran) else "decode"
    now = owners(engine)
    events = []
    for name, seq in SEQS.items():
        if seq.num_preemptions > preemptions[name]:
            events.append(f"preempt {name} (-{held_before[name]})")
            preempted_events.append((step, name))
    for seq in finished:
        name = NAMES[seq.seq_id]
        finished_names.add(name)
        num_freed = -(-(len(seq) - 1) // BLOCK_SIZE)  # it held blocks for all but its last token
        events.append(f"finish {name} (-{num_freed})")
    if kind == "prefill":
        again = [n for n in ran if SEQS[n].num_preemptions > 0 and held_before[n] == 0]
        events += [f"{n} recomputes {lengths[n]} tokens" for n in again]
    events += gains(step, before, now)
    last_holder.update(now)
    free_counts.append(engine.manager.num_free_blocks)

    free = f"free {engine.manager.num_free_blocks:2d}"
    print(f"{step:2d} {kind:<7} {''.join(ran):<6}|{pool_row(now)}| {free}  " + ", ".join(events))
    first_reuse = reuses_after_finish and reuses_after_finish[0][0] == step
    if step == 1 or first_reuse or any(e.startswith("preempt") for e in events):
        print(tables(engine))


step = 0
while engine.has_unfinished() or any(arrival > step for arrival, _, _ in WORKLOAD.values()):
    step += 1
    arrive(step)
    if engine.has_unfinished():
        run_step(step)

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
