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
# # Stage 11: host and device, step by step
#
# Up to stage 10 the host and the device take turns: the host schedules and packs a step, the
# device runs it, the host samples and appends the tokens, and only then does the next step
# begin. Stage 11 runs the same loop (schedule, execute, update), one step ahead of its own
# tokens. Each call of `engine.step()` schedules and launches step N + 1, then waits for step N's
# tokens, and `update` lands N and commits N + 1, so the host's work for the next step happens
# while the device computes the current one.
#
# This notebook draws that as a timeline, twice:
#
# 1. **On the H200**, from the stamps `tools/profile_overlap.py` recorded (`--json`): every host
#    phase on the host's clock, and each step's device work between two CUDA events. The files
#    are in `docs/data/`; the notebook draws every one it finds.
# 2. **On your CPU, live**, with a tiny random model: the same host phases, stamped the same way,
#    for stage 09's loop and stage 11's. A CPU has no separate device, so this picture shows the
#    *order* of the work, not the overlap.
#
# To trace your own loop in the second part, open `notebooks/11_overlap.py` in Jupyter (jupytext
# opens it as a notebook) and set `IMPL`. `pip install -e '.[notebooks]'` installs JupyterLab,
# jupytext and matplotlib; then `jupyter lab notebooks/` and, on the file, *Open With -> Jupytext
# Notebook*.

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
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

import nanoserve
from nanoserve import LLM, SamplingParams, grading
from nanoserve.testing import save_tiny_model

# What runs stage 11 in the live trace: "ref" (the reference in src/nanoserve), "starter" (the
# stage's starter.py), a path to your own .py file (absolute, or relative to this notebook's
# folder) or a dotted module name: the same values `pytest --impl` and `nanoserve check` accept.
# Its PersistentBatch and OverlapScheduler (your commit and land) run in the engine.
IMPL = "ref"

mine = grading.load_impl(11, IMPL)
components = {"PersistentBatch": mine.PersistentBatch, "OverlapScheduler": mine.OverlapScheduler}
print(f"stage 11's PersistentBatch and OverlapScheduler from {IMPL!r}")

# %% [markdown]
# ## The H200's stamps
#
# Each file holds what `profile_overlap.py` measured for one stage: `phases`, a list of
# `[name, start_ms, end_ms]` on the host's clock; `device`, one `[start_ms, end_ms]` per step,
# the step's device work between an event enqueued before its first kernel and one after its
# last, on the same clock; `step_starts_ms`, when each call of `engine.step()` began; and the
# medians `wall_ms` (a call), `busy_ms` (the device's part) and `exposed_host_ms` (the rest: host
# time the device waited for). Stage 09's phases are `schedule`, `prepare`, `run` (forward,
# sampling, and the wait for the tokens) and `postprocess`; stage 11's are `schedule`, `launch`,
# `resolve` and `commit`. (These files were recorded before every stage ran one loop: stage 11's
# `resolve`, the wait for the step before and the appending of its tokens, is today's `land`.)


# %%
def repository_root() -> Path:
    """The checkout holding docs/data: above the working directory, or above the package."""
    here = Path.cwd().resolve()
    package = Path(nanoserve.__file__).resolve()
    for folder in [here, *here.parents, *package.parents]:
        if (folder / "docs" / "data").is_dir():
            return folder
    raise FileNotFoundError("no docs/data folder above this notebook or the nanoserve package")


DATA = repository_root() / "docs" / "data"
RECORDINGS = {  # file -> title; a file not recorded yet is left out
    "timeline_h200_stage9_b256.json": "stage 09, batch 256",
    "timeline_h200_stage11_b256.json": "stage 11, batch 256",
    "timeline_h200_stage11_b1.json": "stage 11, batch 1",
}
runs = {}
for name, title in RECORDINGS.items():
    path = DATA / name
    if path.exists():
        (runs[title],) = json.loads(path.read_text())  # one stage per file
    else:
        print(f"{name}: not recorded yet, left out")
for title, run in runs.items():
    print(
        f"{title}: {run['backend']}, graphs {'on' if run['graphs'] else 'off'}, context "
        f"{run['context']}: step {run['wall_ms']:.3f} ms, device busy {run['busy_ms']:.3f} ms, "
        f"host exposed {run['exposed_host_ms']:.3f} ms"
    )

# %% [markdown]
# The medians of each host phase, and of the device's part of a step:


# %%
def medians(run: dict) -> dict[str, float]:
    """Median ms of each host phase, and of each step's device interval."""
    by_phase: dict[str, list[float]] = {}
    for name, start, end in run["phases"]:
        by_phase.setdefault(name, []).append(end - start)
    by_phase["device"] = [end - start for start, end in run["device"]]
    return {name: statistics.median(ms) for name, ms in by_phase.items()}


for title, run in runs.items():
    print(f"{title:<20} " + ", ".join(f"{k} {v:.3f}" for k, v in medians(run).items()))

# %% [markdown]
# ## The timeline
#
# One picture per recording: a few consecutive calls of `engine.step()` from the middle of the
# run, the host's phases on the upper lane and the device's steps on the lower one, on one
# clock. Vertical lines mark where each call of `step()` began. In stage 11's lane the gap
# between `launch` and `resolve` is the host waiting for the step before's tokens: time the host
# has to spare. A gap in the device lane is time the device waited for the host. (The drawing
# code, plain matplotlib, is in the next cell of the notebook; the docs site hides it.)

# %% tags=["hide-input"]
# Okabe-Ito colours, distinguishable with the common colour-vision deficiencies.
PHASE_COLOURS = {
    "schedule": "#0072B2",
    "prepare": "#E69F00",
    "run": "#CC79A7",
    "postprocess": "#D55E00",
    "launch": "#009E73",
    "resolve": "#56B4E9",
    "commit": "#F0E442",
    "execute": "#CC79A7",  # the live trace: stage 09's step, forward and sampling and the wait
    "land": "#56B4E9",
}
DEVICE_COLOUR = "#555555"
plt.rcParams["figure.dpi"] = 100


def calls_in_window(run: dict, num_calls: int) -> tuple[int, int]:
    """The first and last+1 call of a window of num_calls from the middle of the run."""
    num = len(run["step_starts_ms"]) - 1
    first = max(0, min(num // 2, num - num_calls))
    return first, min(num, first + num_calls)


def draw_recording(ax, title: str, run: dict, num_calls: int = 5) -> None:
    """Host phases above, device steps below, for a window of calls; ms from its start."""
    first, last = calls_in_window(run, num_calls)
    starts = run["step_starts_ms"]
    t0, t1 = starts[first], starts[last]
    for name, start, end in run["phases"]:
        if end > t0 and start < t1:
            ax.broken_barh([(start - t0, end - start)], (1.1, 0.8), color=PHASE_COLOURS[name])
    for i, (start, end) in enumerate(run.get("device", [])):
        if end > t0 and start < t1:
            ax.broken_barh([(start - t0, end - start)], (0.1, 0.8), color=DEVICE_COLOUR)
            mid = (max(start, t0) + min(end, t1)) / 2 - t0
            ax.text(mid, 0.5, f"step {i + 1}", ha="center", va="center", color="white", fontsize=8)
    for start in starts[first : last + 1]:
        ax.axvline(start - t0, color="#999999", linewidth=0.8, linestyle=":")
    ax.set_xlim(0, t1 - t0)
    ax.set_ylim(0, 2)
    ax.set_yticks([0.5, 1.5], ["device", "host"])
    ax.set_xlabel("ms")
    ax.set_title(
        f"H200, {title}: calls {first + 1}-{last} of step(); step {run['wall_ms']:.3f} ms, "
        f"device busy {run['busy_ms']:.3f} ms",
        fontsize=10,
        loc="left",
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def draw_recordings(runs: dict) -> None:
    """One panel per recording, with one legend for the phases that appear."""
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(11, 1.9 * len(runs) + 0.9), layout="constrained", squeeze=False
    )
    for ax, (title, run) in zip(axes[:, 0], runs.items()):
        draw_recording(ax, title, run)
    seen = {name for run in runs.values() for name, _, _ in run["phases"]}
    handles = [Patch(color=c, label=n) for n, c in PHASE_COLOURS.items() if n in seen]
    handles.append(Patch(color=DEVICE_COLOUR, label="device: one step's kernels"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    plt.show()


# %%
if runs:
    draw_recordings(runs)

# %% [markdown]
# What to look for, in the recordings that exist:
#
# - **Stage 09 at batch 256.** Every call is schedule, prepare, run, postprocess, and the device
#   works only inside `run`: between two of its steps there is a gap as long as postprocess,
#   schedule and prepare together. That gap is the host time the device waits for.
# - **Stage 11 at batch 256.** The device lane has no gaps: each step starts the moment the one
#   before it ends. The host's `schedule` and `launch` for the next step sit under the device's
#   current step; then the host waits (the white stretch), resolves and commits.
# - **Stage 11 at batch 1.** The device's step is short, and `launch` (the decode inputs built
#   from the rows, the graph replay, the sampling kernel and the copy of the tokens, all queued)
#   takes a good part of it. Still it ends before the device's step does, so the device never
#   waits.
#
# The label `step i` counts the steps of the recording, not of the engine: the profile starts
# after the prefill and a few warm-up steps. In stage 11, call `i` of `step()` launches step `i`
# and lands step `i - 1`.

# %% [markdown]
# ## A trace on your CPU
#
# Stamps recorded live. Four requests of 12 to 30 prompt tokens on a tiny random model (two
# layers, float64), greedy, 10 tokens each, on stage 09 and on stage 11. Both run the same loop,
# `plan = schedule(); out = runner.execute(plan); update(plan, out)`, and `update` calls the same
# two halves, `land` and `commit`. `Stamps` wraps the methods a step calls and notes which step
# each call serves, by its plan: `schedule` makes the plan, `execute` (stage 09) or `launch`
# (stage 11) runs it, `commit` records its progress and `land` its tokens.


# %%
class Stamps:
    """Host phases of an engine's steps: (call, phase, step it serves, start ms, end ms)."""

    def __init__(self, engine):
        self.engine = engine
        self.t0 = time.perf_counter()
        self.call = 0
        self.phases: list[tuple[int, str, int, float, float]] = []
        self.plans: dict[int, tuple[object, int]] = {}  # id(plan) -> (plan, its step)

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def step_of(self, plan) -> int | None:
        """The step a plan ran as; None for an empty plan (nothing launched)."""
        kept = self.plans.get(id(plan))
        return kept[1] if kept is not None and kept[0] is plan else None

    def wrap(self, obj, name: str, plan_of) -> None:
        """Stamp every call of obj.name; plan_of(args, result) is the plan the call serves."""
        inner = getattr(obj, name)

        @functools.wraps(inner)
        def stamped(*args, **kwargs):
            start = self.now()
            result = inner(*args, **kwargs)
            plan = plan_of(args, result)
            if name == "schedule" and plan.seqs:  # a plan that runs: the engine's next step
                self.plans[id(plan)] = (plan, self.engine.num_steps + 1)
            step = self.step_of(plan)
            if step is not None:
                self.phases.append((self.call, name, step, start, self.now()))
            return result

        setattr(obj, name, stamped)


def stamped_engine(stage: int) -> tuple[LLM, Stamps]:
    """An engine of the stage on the tiny model, its phases stamped."""
    llm = LLM(
        folder,
        stage=stage,
        device="cpu",
        dtype="float64",
        block_size=4,
        max_model_len=64,
        components=components if stage == 11 else None,
    )
    engine, runner = llm.engine, llm.engine.runner
    stamps = Stamps(engine)
    stamps.wrap(engine.scheduler, "schedule", lambda args, plan: plan)
    if stage == 11:
        stamps.wrap(runner, "launch", lambda args, launched: args[0])
    else:
        stamps.wrap(runner, "execute", lambda args, out: args[0])
    stamps.wrap(engine.scheduler, "land", lambda args, finished: args[0].plan)
    stamps.wrap(engine.scheduler, "commit", lambda args, result: args[0])
    return llm, stamps


folder = save_tiny_model(tempfile.mkdtemp(prefix="nanoserve-nb11-"), "llama")
PROMPTS = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate([12, 20, 25, 30])]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)

traces, tokens = {}, {}
for stage in (9, 11):
    llm, stamps = stamped_engine(stage)
    seqs = [llm.engine.add_request(p, PARAMS) for p in PROMPTS]
    while llm.engine.has_unfinished():
        stamps.call += 1
        llm.engine.step()
    traces[stage], tokens[stage] = stamps, [s.completion_token_ids for s in seqs]
    print(f"stage {stage:02d}: {llm.engine.num_steps} steps in {stamps.call} calls of step()")
assert tokens[11] == tokens[9], "stage 11's greedy tokens must equal stage 09's"
print("greedy tokens identical")

# %% [markdown]
# The order of the work, call by call, for the first calls: each entry is `phase step`.

# %%
for stage, stamps in traces.items():
    print(f"stage {stage:02d}")
    for call in range(1, 5):
        order = [f"{name} {step}" for c, name, step, _, _ in stamps.phases if c == call]
        print(f"  call {call}: " + " | ".join(order))

# %% [markdown]
# Stage 09 does everything for step `N` in call `N`: its runner waits for the step's tokens, so
# `update` commits step `N` and lands it at once. Stage 11's call `N` launches step `N`, lands
# step `N - 1` (the runner waited for it after the launch) and commits step `N`; its first call
# lands nothing, and its last only lands. Drawn, one row per call, each phase at its time within
# the call:


# %% tags=["hide-input"]
def draw_calls(ax, stage: int, stamps: Stamps, calls: range) -> None:
    """One row per call of step(): its phases, from its first stamp; its steps on the right."""
    for call in calls:
        phases = [p for p in stamps.phases if p[0] == call]
        if not phases:
            continue
        t0 = phases[0][3]
        for _, name, _, start, end in phases:
            ax.broken_barh([(start - t0, end - start)], (call - 0.4, 0.8),
                           color=PHASE_COLOURS[name])  # fmt: skip
        step_of = {name: step for _, name, step, _, _ in phases}
        served = f"step {step_of['execute']}" if stage == 9 else f"launch {step_of['launch']}"
        if stage == 11 and "land" in step_of:
            served += f", land {step_of['land']}"
        ax.text(1.01, call, served, transform=ax.get_yaxis_transform(), va="center",
                fontsize=8, family="monospace")  # fmt: skip
    ax.set_yticks(list(calls), [f"call {c}" for c in calls])
    ax.set_xlabel("ms since the call began (CPU)")
    ax.set_title(f"stage {stage:02d}", loc="left", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


CALLS = range(2, 8)  # decode steps; call 1, the prefill, is printed above
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), layout="constrained", sharey=True)
for ax, (stage, stamps) in zip(axes, traces.items()):
    draw_calls(ax, stage, stamps, CALLS)
axes[0].invert_yaxis()  # the axes share y: invert once, first call on top
seen = {name for stamps in traces.values() for _, name, _, _, _ in stamps.phases}
handles = [Patch(color=c, label=n) for n, c in PHASE_COLOURS.items() if n in seen]
fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
plt.show()

# %% [markdown]
# Right of each row, the steps the call served. In stage 11 the gap between `launch` and `land`
# is the runner waiting for the step before (inside `execute`, not stamped). On a CPU, `launch`
# holds the whole forward pass and the sampling: there is no device to hand them to, so a call
# takes about as long as stage 09's. On a GPU, `launch` returns as soon as the work is queued,
# and the same order lets the host's `schedule`, `launch`, `land` and `commit` run while the
# device computes.
#
# ## What must be true
#
# Every call of stage 11 after the first lands the step launched in the call before it, and
# commits the step it launched itself; the run needs one call more than it has steps (the last
# call launches nothing and only lands).


# %%
stamps = traces[11]
launched_in = {step: c for c, name, step, _, _ in stamps.phases if name == "launch"}
for c, name, step, _, _ in stamps.phases:
    if name == "land":
        assert launched_in[step] == c - 1, f"call {c} landed step {step}"
    if name == "commit":
        assert launched_in[step] == c, f"call {c} committed step {step}"
assert stamps.call == len(launched_in) + 1
print(f"{len(launched_in)} steps launched, each landed one call later")
