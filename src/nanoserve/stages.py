"""The stage manifest: the single source of truth for what each of the stages is and has.

Introduced in stage 00. The README table, the docs, `nanoserve stages`, `nanoserve check`, the
equivalence chain and the harness self-tests all read this list; nothing else hard-codes a stage
number or path. What a stage's engine is made of is its recipe (recipes/<slug>.py), and so is
what its learner writes (`api`, imported by `learner_api.py`); what a row holds is
`stage_record.py`'s `Stage`.
"""

from __future__ import annotations

from nanoserve.stage_record import Stage, StageStatus

__all__ = ["STAGES", "Stage", "StageStatus"]  # the record's names, re-exported with the manifest


STAGES: tuple[Stage, ...] = (
    Stage(
        number=0,
        stem="00_model",
        title="The model",
        summary="decoder, loaders, sampler; generation recomputes everything (no KV cache)",
        oracle=None,
        proven_equal_to="Hugging Face transformers",
        reference_modules=(
            "models/decoder.py",
            "models/loader.py",
            "models/gguf.py",
            "layers/norm.py",
            "layers/rotary.py",
            "kernels/attention.py",
            "sampling.py",
            "cache/no_cache.py",
            "engine/memory/kv_manager.py",
            "recipes/model.py",
        ),
    ),
    Stage(
        number=1,
        stem="01_contiguous_cache",
        title="Contiguous KV cache",
        summary="one K/V slab per sequence, sized for max_model_len",
        oracle=0,
        proven_equal_to="stage 00",
        reference_modules=(
            "cache/contiguous.py",
            "kernels/slab_attention.py",
            "engine/memory/slab_manager.py",
            "cache/budget.py",
            "recipes/contiguous_cache.py",
        ),
    ),
    Stage(
        number=2,
        stem="02_block_allocator",
        title="Block allocator",
        summary="a pool of fixed-size block ids: LIFO free list, all-or-nothing allocation",
        oracle=None,
        proven_equal_to="a set-based model (property test)",
        reference_modules=("engine/memory/allocator.py", "recipes/block_allocator.py"),
    ),
    Stage(
        number=3,
        stem="03_block_table",
        title="Block table",
        summary="logical position -> (block, offset) -> flat slot; lazy growth",
        oracle=None,
        proven_equal_to="bulk allocation (decode growth == prefill)",
        reference_modules=(
            "engine/memory/block_table.py",
            "engine/memory/table_manager.py",
            "cache/slot_cache.py",
            "kernels/slot_attention.py",
            "recipes/block_table.py",
        ),
        has_notebook=True,
    ),
    Stage(
        number=4,
        stem="04_paged_pool",
        title="Paged KV pool",
        summary="one pool tensor, slot-mapped writes, block-table reads, a block scheduler with "
        "continuous batching and preemption",
        oracle=1,
        proven_equal_to="stage 01",
        reference_modules=(
            "cache/paged.py",
            "kernels/torch_paged.py",
            "engine/runner/input_packer.py",
            "engine/runner/step_tensors.py",
            "engine/memory/block_manager.py",
            "recipes/paged_pool.py",
        ),
        has_notebook=True,
    ),
    Stage(
        number=5,
        stem="05_triton_store",
        title="Triton store kernel",
        summary="a Triton store_kvcache kernel writes K/V into slots",
        oracle=4,
        proven_equal_to="stage 04 (pool bytes identical)",
        reference_modules=("kernels/store.py", "recipes/triton_store.py"),
    ),
    Stage(
        number=6,
        stem="06_paged_attention",
        title="Paged attention kernels",
        summary="attention reads K/V straight from scattered pages (varlen prefill, split-K "
        "decode)",
        oracle=5,
        proven_equal_to="stage 05",
        reference_modules=(
            "kernels/paged_tiles.py",
            "kernels/paged_prefill.py",
            "kernels/paged_decode.py",
            "kernels/triton_backend.py",
            "recipes/paged_attention.py",
        ),
        has_notebook=True,
    ),
    Stage(
        number=7,
        stem="07_prefix_cache",
        title="Prefix cache",
        summary="chained hashes of full blocks, ref counts, sharing cached pages",
        oracle=6,
        proven_equal_to="stage 06 (fewer prefill tokens, same output)",
        reference_modules=("engine/memory/prefix_block_manager.py", "recipes/prefix_cache.py"),
        has_notebook=True,
    ),
    Stage(
        number=8,
        stem="08_cuda_graphs",
        title="CUDA graphs",
        summary="captured decode graphs per batch-size bucket, static input buffers",
        oracle=7,
        proven_equal_to="stage 07",
        reference_modules=(
            "engine/runner/cuda_graphs.py",
            "engine/runner/graph_buffers.py",
            "engine/runner/input_packer.py",
            "layers/compiled.py",
            "recipes/cuda_graphs.py",
            "recipes/assemble.py",
        ),
        needs_gpu=True,
    ),
    Stage(
        number=9,
        stem="09_tensor_parallel",
        title="Tensor parallelism",
        summary="column/row/vocab-parallel layers, worker processes, NCCL (gloo on CPU)",
        oracle=8,
        proven_equal_to="stage 08 with one rank",
        reference_modules=(
            "layers/shards.py",
            "layers/tensor_parallel.py",
            "layers/weight_loader.py",
            "layers/linear.py",
            "layers/embedding.py",
            "layers/activation.py",
            "parallel/process_group.py",
            "parallel/worker.py",
            "parallel/group.py",
            "recipes/tensor_parallel.py",
        ),
    ),
    Stage(
        number=10,
        stem="10_serving",
        title="Serving",
        summary="an async engine loop and an OpenAI-compatible HTTP server: streaming, abort on "
        "disconnect, metrics",
        oracle=9,
        proven_equal_to="stage 09 (served tokens equal offline ones)",
        reference_modules=(
            "serving/async_engine.py",
            "serving/engine_thread.py",
            "serving/request_stream.py",
            "serving/server.py",
            "serving/served_model.py",
            "serving/completion.py",
            "serving/generation.py",
            "serving/protocol.py",
            "serving/openai_fields.py",
            "serving/chat_messages.py",
            "serving/responses.py",
            "serving/text.py",
            "serving/metrics.py",
            "bench/serve.py",
            "bench/clients.py",
            "recipes/serving.py",
        ),
    ),
    Stage(
        number=11,
        stem="11_overlap",
        title="Overlap scheduling",
        summary="batch state on the device by row, sampling on the device, step N + 1 scheduled "
        "and launched while step N runs",
        oracle=9,
        proven_equal_to="stage 09 (greedy; seeded sampling is a new stream, checked by chi-square)",
        reference_modules=(
            "engine/runner/persistent_batch.py",
            "engine/runner/overlap_runner.py",
            "engine/runner/launched.py",
            "engine/loop/scheduler.py",
            "samplers/device_sampler.py",
            "recipes/overlap.py",
        ),
        has_notebook=True,
    ),
    Stage(
        number=12,
        stem="12_speculative",
        title="Speculative decoding",
        summary="n-gram and draft proposers (opt-in, as vLLM's), one-forward verification of k "
        "guesses launched ahead (overlapped like stage 11's steps), guesses per sequence by "
        "batch size, rejection sampling, rollback in the block table",
        oracle=11,
        proven_equal_to="stage 11 (greedy); the target's distribution (sampling, by chi-square)",
        reference_modules=(
            "engine/speculation/ngram_proposer.py",
            "samplers/rejection.py",
            "engine/loop/scheduler.py",
            "engine/speculation/policy.py",
            "engine/speculation/draft_proposer.py",
            "samplers/speculative_sampler.py",
            "recipes/speculative.py",
        ),
        has_notebook=True,
    ),
    Stage(
        number=13,
        stem="13_fp8_kv_cache",
        title="FP8 KV cache",
        summary="an e4m3 KV pool with a power-of-two scale per (block, KV head): a quantizing "
        "store kernel, attention kernels that dequantize in registers, twice the tokens in the "
        "pool (opt-in, kv_cache_dtype='fp8'); the first lossy stage",
        oracle=12,
        proven_equal_to="stage 12 (auto); with fp8, stage 11 run on the dequantized K/V (token "
        "for token), and a measured bound on the loss (KL, perplexity, greedy agreement)",
        reference_modules=(
            "cache/fp8.py",
            "cache/fp8_pool.py",
            "kernels/torch_fp8.py",
            "kernels/e4m3.py",
            "kernels/store_fp8.py",
            "kernels/paged_tiles.py",
            "recipes/fp8_kv_cache.py",
        ),
        has_notebook=True,
    ),
)


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
