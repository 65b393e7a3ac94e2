"""Stage 08: decode steps captured once per batch-size bucket as CUDA graphs, then replayed.

Introduced in stage 08. A decode step launches hundreds of small kernels whose launch cost, at
H200 speed, rivals their run time. A CUDA graph records the launches once, on fixed tensors, and
replays them with one call. So every input lives in a static buffer sized for the largest bucket;
a step copies its rows in (padding rows write to slot -1 and read context length 0), replays the
smallest bucket that holds it, and reads the hidden states back out. Prefill, batches above the
largest bucket and CPU runs stay eager. The sampler and the LM head run outside the graph.

    buckets (max_num_seqs 40):  1  2  4  8  16  32  40      a batch of 11 replays bucket 16
    static buffers:  input_ids, positions, slot_mapping, context_lens  (40,)
                     block_tables (40, ceil(max_model_len / block_size))   the widest a table gets
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nanoserve.engine.memory.kv_manager import blocks_for
from nanoserve.engine.runner.graph_buffers import static_decode_inputs, view_rows
from nanoserve.engine.runner.input_packer import pad_decode
from nanoserve.types import StepInputs

logger = logging.getLogger("nanoserve")


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, and always max_num_seqs itself as the largest."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 16))
    return [*buckets, max_num_seqs]


def bucket_for(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds batch_size sequences; None above the largest."""
    return next((b for b in buckets if b >= batch_size), None)


def table_width(max_model_len: int, block_size: int) -> int:
    """Block-table columns a sequence of max_model_len tokens can need (its last token included)."""
    return blocks_for(max_model_len, block_size)


def fill_static(static: StepInputs, step: StepInputs) -> None:
    """Copy a padded decode step into the static buffers' first rows (same shapes)."""
    rows = step.input_ids.shape[0]
    target = view_rows(static, rows)
    for name in ("input_ids", "positions"):
        getattr(target, name).copy_(getattr(step, name))
    for name in ("cu_seqlens_k", "slot_mapping", "context_lens", "block_tables"):
        getattr(target.metadata, name).copy_(getattr(step.metadata, name))


@contextmanager
def undisturbed_capture(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """Capture into graph with nothing else touching CUDA meanwhile.

    A capture is invalidated (cudaErrorStreamCaptureInvalidated at its end) by any unsafe CUDA
    call made while it records. Two such calls come from outside the forward being recorded:
    the garbage collector freeing an old step's pinned host buffer (the host allocator records
    an event on the stream that used it), and another thread (a server, an earlier engine).
    So the collector runs before and is off during the capture, and the capture refuses unsafe
    calls from this thread only ("thread_local"), not from every thread ("global").
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()


class DecodeGraphs:
    """One captured decode graph per bucket over one set of static buffers, and their replay."""

    def __init__(self, model, attention, max_num_seqs: int, width: int, device):
        self.model, self.attention = model, attention
        self.buckets = graph_buckets(max_num_seqs)
        self.width = width
        self.static = static_decode_inputs(self.buckets[-1], width, device)
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its hidden states (bucket, hidden)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # their memory pool once captured (stage 11's step graphs share it)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and record every bucket, largest first, in one shared memory pool."""
        start, before = time.perf_counter(), torch.cuda.memory_allocated()
        pool = None
        for bucket in reversed(self.buckets):
            inputs = view_rows(self.static, bucket)
            self.forward(inputs)  # eager once: Triton compiles, torch picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with undisturbed_capture(graph, pool):
                self.outputs[bucket] = self.forward(inputs)
            pool = graph.pool()
            self.graphs[bucket] = graph
        self.pool = pool
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (buckets %s) in %.1f s, %.1f MiB",
            len(self.graphs),
            self.buckets,
            time.perf_counter() - start,
            (torch.cuda.memory_allocated() - before) / 2**20,
        )

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over decode inputs, eagerly (what each graph records; stage 11's whole-step
        graphs record it inside theirs)."""
        return self.model(inputs.input_ids, inputs.positions, self.attention, inputs.metadata)

    def can_replay(self, step: StepInputs) -> bool:
        """True for a decode step that fits a bucket and the captured table width."""
        md = step.metadata
        return (
            not md.is_prefill
            and bucket_for(md.num_seqs, self.buckets) is not None
            and md.block_tables.shape[1] <= self.width
        )

    def replay(self, step: StepInputs) -> torch.Tensor:
        """Hidden states (num_seqs, hidden) of an unpadded decode step, by graph replay."""
        num_seqs = step.metadata.num_seqs
        bucket = bucket_for(num_seqs, self.buckets)
        if bucket is None:
            raise ValueError(f"no captured bucket holds {num_seqs} sequences; ask can_replay first")
        fill_static(self.static, pad_decode(step, bucket, self.width))  # padding rows included
        return self.replay_filled(num_seqs)

    def replay_filled(self, num_seqs: int) -> torch.Tensor:
        """Hidden states (num_seqs, hidden) by replaying the bucket of num_seqs over the static
        buffers as they are: whoever calls it has written the bucket's rows (stage 11 writes
        them on the device, from its persistent batch)."""
        bucket = bucket_for(num_seqs, self.buckets)
        if bucket is None:
            raise ValueError(f"no captured bucket holds {num_seqs} sequences")
        self.graphs[bucket].replay()
        return self.outputs[bucket][:num_seqs]
