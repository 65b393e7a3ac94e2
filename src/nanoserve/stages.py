"""The stage manifest: the single source of truth for what each of the stages is and has.

Introduced in stage 00. The README table, the docs, `nanoserve stages`, `nanoserve check` and the
harness self-tests all read this list; nothing else hard-codes a stage number or path.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StageStatus(Enum):
    """Whether a stage's reference code exists yet."""

    IMPLEMENTED = "implemented"
    PLANNED = "planned"


@dataclass(frozen=True)
class Stage:
    """One day-sized step of the curriculum."""

    number: int
    stem: str
    title: str
    summary: str
    proven_equal_to: str
    reference_modules: tuple[str, ...]
    needs_gpu: bool
    status: StageStatus
    has_notebook: bool = False

    @property
    def lesson(self) -> str:
        """The lesson a learner follows."""
        return f"stages/{self.stem}/README.md"

    @property
    def starter(self) -> str:
        """The learner's file: the stage API with NotImplementedError bodies."""
        return f"stages/{self.stem}/starter.py"

    @property
    def test_file(self) -> str:
        """The graded contract, run with --impl."""
        return f"stages/{self.stem}/test_{self.stem}.py"

    @property
    def docs_page(self) -> str:
        """The stage's page on the docs site."""
        return f"docs/stages/{self.stem}.md"

    @property
    def notebook(self) -> str | None:
        """The jupytext notebook, for stages that draw something."""
        return f"notebooks/{self.stem}.py" if self.has_notebook else None

    @property
    def oracle_stage(self) -> int | None:
        """The earlier stage whose tokens this one must reproduce, if it is proven by tokens."""
        words = self.proven_equal_to.split()
        return int(words[1]) if words[0] == "stage" else None

    @property
    def is_implemented(self) -> bool:
        """True when the reference code exists and `LLM(stage=number)` works."""
        return self.status is StageStatus.IMPLEMENTED


_I, _P = StageStatus.IMPLEMENTED, StageStatus.PLANNED

STAGES: tuple[Stage, ...] = (
    Stage(0, "00_model", "The model",
          "decoder, loaders, sampler; generation recomputes everything (no KV cache)",
          "Hugging Face transformers",
          ("models/decoder.py", "models/loader.py", "models/gguf.py", "layers/norm.py",
           "layers/rotary.py", "kernels/attention.py", "sampling.py", "cache/no_cache.py",
           "engine/kv_manager.py"),
          False, _I),
    Stage(1, "01_contiguous_cache", "Contiguous KV cache",
          "one K/V slab per sequence, sized for max_model_len", "stage 00",
          ("cache/contiguous.py", "engine/slab_manager.py", "cache/budget.py"), False, _I),
    Stage(2, "02_block_allocator", "Block allocator",
          "a pool of fixed-size block ids: LIFO free list, all-or-nothing allocation",
          "a set-based model (property test)", ("engine/allocator.py",), False, _I),
    Stage(3, "03_block_table", "Block table",
          "logical position -> (block, offset) -> flat slot; lazy growth",
          "bulk allocation (decode growth == prefill)",
          ("engine/block_table.py", "engine/table_manager.py", "cache/slot_cache.py"), False, _I,
          has_notebook=True),
    Stage(4, "04_paged_pool", "Paged KV pool",
          "one pool tensor, slot-mapped writes, block-table reads, a block scheduler with "
          "continuous batching and preemption", "stage 01",
          ("cache/paged.py", "cache/attention_metadata.py", "engine/block_manager.py"), False,
          _I, has_notebook=True),
    Stage(5, "05_triton_store", "Triton store kernel",
          "a Triton store_kvcache kernel writes K/V into slots", "stage 04 (pool bytes identical)",
          ("kernels/store.py",), False, _I),
    Stage(6, "06_paged_attention", "Paged attention kernels",
          "attention reads K/V straight from scattered pages (varlen prefill, split-K decode)",
          "stage 05", ("kernels/paged_tiles.py", "kernels/paged_prefill.py",
                       "kernels/paged_decode.py", "kernels/triton_backend.py"), False, _I,
          has_notebook=True),
    Stage(7, "07_prefix_cache", "Prefix cache",
          "chained hashes of full blocks, ref counts, sharing cached pages",
          "stage 06 (fewer prefill tokens, same output)",
          ("engine/prefix_block_manager.py",), False, _I, has_notebook=True),
    Stage(8, "08_cuda_graphs", "CUDA graphs",
          "captured decode graphs per batch-size bucket, static input buffers", "stage 07",
          ("engine/cuda_graphs.py", "cache/attention_metadata.py", "layers/compiled.py"), True,
          _I),
    Stage(9, "09_tensor_parallel", "Tensor parallelism",
          "column/row/vocab-parallel layers, worker processes, NCCL (gloo on CPU)",
          "stage 08 with one rank",
          ("layers/tensor_parallel.py", "layers/linear.py", "layers/embedding.py",
           "layers/activation.py", "parallel/process_group.py", "parallel/worker.py",
           "parallel/group.py"), False, _I),
    Stage(10, "10_serving", "Serving",
          "an async engine loop and an OpenAI-compatible HTTP server: streaming, abort on "
          "disconnect, metrics", "stage 09 (served tokens equal offline ones)",
          ("engine/async_engine.py", "engine/request_stream.py", "serving/server.py",
           "serving/generation.py", "serving/protocol.py", "serving/text.py",
           "serving/metrics.py", "bench/serve.py", "bench/clients.py"), False, _I),
)  # fmt: skip


def get_stage(number: int) -> Stage:
    """The stage with this number; ValueError naming the valid range otherwise."""
    if not isinstance(number, int) or not 0 <= number < len(STAGES):
        raise ValueError(f"stage must be an integer 0..{len(STAGES) - 1}, got {number!r}")
    return STAGES[number]


def latest_stage() -> Stage:
    """The newest implemented stage (the default engine)."""
    return [s for s in STAGES if s.is_implemented][-1]


def implemented_stages() -> list[Stage]:
    """Every stage whose reference code exists."""
    return [s for s in STAGES if s.is_implemented]


def require_implemented(number: int) -> Stage:
    """The stage, or a ValueError that names what exists when it is only planned."""
    stage = get_stage(number)
    if not stage.is_implemented:
        done = ", ".join(f"{s.number} ({s.stem})" for s in implemented_stages())
        raise ValueError(
            f"stage {number} ({stage.stem}) is planned, not implemented yet; "
            f"implemented stages: {done}"
        )
    return stage


def markdown_table() -> str:
    """The stage table as Markdown: the README shows exactly this (a test keeps them in step)."""
    rows = [
        "| # | stage | adds | proven equal to | status |",
        "|---|---|---|---|---|",
    ]
    for s in STAGES:
        gpu = " (GPU)" if s.needs_gpu else ""
        rows.append(
            f"| {s.number:02d} | `{s.stem}`{gpu} | {s.summary} | {s.proven_equal_to} "
            f"| {s.status.value} |"
        )
    return "\n".join(rows)
