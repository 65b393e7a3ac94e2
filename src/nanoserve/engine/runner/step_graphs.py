"""Stage 11's whole decode step as one CUDA graph: inputs, forward, LM head, sampler and record.

Introduced in stage 11, given to its learner. Stage 08 captures the forward only; around its
replay a decode step still launches about fifty small kernels from Python (the inputs built from
the device batch, the LM head, the sampler, the record). On the H200 with a small model that host
work is the step: SmolLM2-135M at batch 1 spent 1.5 ms launching a step whose forward replays in
a fraction of that (docs/benchmarks.md, "A decode step captured whole"). Here the step is
captured whole, once per batch-size bucket (and per `filters`: whether any row cuts its
distribution with top-k or top-p), over the device batch's own tensors:

    host:    rows -> static rows (then the padding row) | replay | copy the tokens up
    graph:   ctx = seq_lens[rows]; inputs (DeviceBatch.fill_rows); forward; logits; sample;
             record (next token, ctx + 1; the padding row keeps ctx 0); tokens -> static tokens

A padding row reads the device batch's `padding_row`, whose context length stays 0: it stores
nothing, reads nothing and writes its draw into that row only. The graph reads the device
batch's tensors by address, so when the batch grows (new tensors) every graph is captured again.

Stage 12's verify step of guesses looked up ahead is captured the same way (`run_verify`): one
shape per bucket (`AheadShape`: sequences, guesses, proposal width), fixed from the speculation
policy and captured at start-up (`plan_verify`), per (greedy, filters); the host copies its packed
ints up and replays; the lookup's picking, the rows, the forward, the verdict and the record are
all inside the graph. One shape per bucket, not one per (guesses, width) a step happens to have:
captured on first use, those shapes were captured inside the timed run, and on the H200 a stage
12 engine's first round ran 0.3-0.8x stage 11 where its later rounds ran 1.0-1.13x
(docs/benchmarks.md, "Verify shapes fixed at start-up").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve.engine.runner.cuda_graphs import DecodeGraphs, bucket_for, undisturbed_capture
from nanoserve.engine.runner.device_batch import DeviceBatch
from nanoserve.engine.runner.graph_buffers import view_rows
from nanoserve.engine.runner.verify_step import AheadShape, AheadVerdict, verify_ahead
from nanoserve.samplers.device_sampler import sample
from nanoserve.samplers.speculative_sampler import Rule
from nanoserve.types import HostMetadata, StepInputs


def blank_host(num_rows: int) -> HostMetadata:
    """Host lists for rows inside a graph, which never reads them."""
    return HostMetadata(list(range(num_rows + 1)), [0] * num_rows, [[]] * num_rows)


class StepGraphs:
    """Decode steps captured whole, per (bucket, filters), over stage 08's static buffers."""

    def __init__(self, model, decode: DecodeGraphs, state: DeviceBatch):
        self.model, self.decode, self.state = model, decode, state
        largest = decode.buckets[-1]
        self.rows = torch.zeros(largest, dtype=torch.int64, device=state.device)  # the step's
        self.tokens = torch.zeros(largest, dtype=torch.int64, device=state.device)  # its draws
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # stage 12: (shape, greedy, filters) -> the graph, its packed ints and its verdict
        self.verifies: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, AheadVerdict]] = {}
        self.verify_ks: dict[int, int] = {}  # stage 12: bucket -> guesses per sequence it holds
        self.verify_width = 0  # proposal tokens per sequence in every verify shape
        self.tables = state.block_tables  # the tensors the graphs read (a grown batch: new ones)

    def fits(self, num_seqs: int) -> bool:
        """True when a captured bucket holds num_seqs rows."""
        return bucket_for(num_seqs, self.decode.buckets) is not None

    @torch.inference_mode()
    def capture(self, filters: bool = False) -> None:
        """Record every bucket's step (largest first), each after one eager run of it."""
        for bucket in reversed(self.decode.buckets):
            self._capture(bucket, filters)

    def _forget_if_moved(self) -> None:
        if self.tables is not self.state.block_tables:  # the batch grew: its tensors moved
            self.graphs.clear()
            self.verifies.clear()
            self.tables = self.state.block_tables

    def _capture(self, bucket: int, filters: bool) -> None:
        self._forget_if_moved()
        self.rows[:bucket] = self.state.padding_row  # every row padding: nothing is written
        self._step(bucket, filters)  # eager once: Triton compiles, torch picks its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with undisturbed_capture(graph, self.decode.pool):
            logits = self._step(bucket, filters)
        self.graphs[(bucket, filters)] = (graph, logits)

    def _step(self, bucket: int, filters: bool) -> torch.Tensor:
        """One decode step over the first `bucket` static rows; its logits (bucket, vocab)."""
        state, rows = self.state, self.rows[:bucket]
        ctx = state.seq_lens[rows]
        static = view_rows(self.decode.static, bucket)
        inputs = state.fill_rows(rows, ctx, state.next_token_ids[rows], blank_host(bucket), static)
        logits = self._logits(inputs)
        positions = ctx.long()  # the token drawn sits right after the context
        tokens = sample(logits, state.sampling(rows, positions, filters))
        state.record(rows, tokens, torch.where(ctx > 0, positions + 1, 0))
        self.tokens[:bucket] = tokens
        return logits

    @torch.inference_mode()
    def run(
        self, rows: torch.Tensor, filters: bool, host: HostMetadata
    ) -> tuple[StepInputs, torch.Tensor, torch.Tensor]:
        """Replay the step of these device rows: (its inputs, for --trace; logits (n, vocab);
        tokens (n,)), all views of static tensors the next replay overwrites."""
        n = len(rows)
        bucket = bucket_for(n, self.decode.buckets)
        assert bucket is not None, "ask fits() first"
        if (bucket, filters) not in self.graphs or self.tables is not self.state.block_tables:
            self._capture(bucket, filters)
        self.rows[:n] = rows
        self.rows[n:bucket] = self.state.padding_row
        graph, logits = self.graphs[(bucket, filters)]
        graph.replay()
        static = view_rows(self.decode.static, n)
        max_len = max(host.context_lens, default=0)
        inputs = static._replace(metadata=static.metadata._replace(max_seqlen_k=max_len, host=host))
        return inputs, logits[:n], self.tokens[:n]

    def _logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits at every row of decode inputs."""
        return self.model.compute_logits(self.decode.forward(inputs))

    # ---- stage 12: the verify step of guesses looked up ahead ----

    def plan_verify(self, guesses_for: Callable[[int], int], rule: Rule) -> None:
        """Fix one verify shape per bucket from the speculation policy, and capture it now
        (greedy and sampled; a step whose rows filter is captured on first use), so that no
        capture lands inside a run. guesses_for: a batch's size -> the guesses each of its
        sequences may take. A bucket's shape holds the most any batch in it may take, as far as
        its rows fit the largest bucket; the width holds any lookup (see `verify_shape`)."""
        buckets, largest = self.decode.buckets, self.decode.buckets[-1]
        self.verify_ks = {}
        for smaller, bucket in zip((0, *buckets), buckets):
            k = max(guesses_for(n) for n in range(smaller + 1, bucket + 1))
            k = min(k, largest // bucket - 1)
            if k > 0:
                self.verify_ks[bucket] = k
        # a lookup asks for a step's budget plus what the step in flight may gain (its budget
        # + 1); launch_ahead adds one
        self.verify_width = 2 * max(self.verify_ks.values(), default=0) + 2
        with torch.inference_mode():
            for bucket, k in reversed(self.verify_ks.items()):
                for greedy in (True, False):
                    shape = AheadShape(bucket, k, self.verify_width)
                    self._capture_verify((shape, greedy, False), rule)

    def verify_shape(self, num_seqs: int, k: int, width: int) -> AheadShape | None:
        """The captured shape that holds a verify step of num_seqs sequences, k guesses each at
        most and proposals width long: its bucket's (`plan_verify`), whose rows past a
        sequence's budget are padding. None when the bucket has no shape or a smaller one (the
        step then runs op by op)."""
        bucket = bucket_for(num_seqs, self.decode.buckets)
        most = self.verify_ks.get(bucket, 0) if bucket is not None else 0
        if bucket is None or k > most or width > self.verify_width:
            return None
        return AheadShape(bucket, most, self.verify_width)

    @torch.inference_mode()
    def run_verify(
        self, rows: torch.Tensor, packed: torch.Tensor, shape: AheadShape, sampling: tuple
    ) -> AheadVerdict:
        """Replay the verify step of these device rows and `pack_ahead` ints (of `shape`);
        capture it first when this (shape, greedy, filters) is new. The verdict's tensors are
        static: the next replay overwrites them."""
        self._forget_if_moved()
        greedy, filters, rule = sampling
        key = (shape, greedy, filters)
        if key not in self.verifies:
            self._capture_verify(key, rule)
        graph, static_packed, verdict = self.verifies[key]
        n = len(rows)
        self.rows[:n] = rows
        self.rows[n : shape.num_seqs] = self.state.padding_row
        static_packed.copy_(packed)
        graph.replay()
        return verdict

    def _capture_verify(self, key: tuple, rule: Rule) -> None:
        shape, greedy, filters = key
        s = shape.num_seqs
        packed = torch.zeros(s * shape.width + 3 * s, dtype=torch.int64, device=self.rows.device)
        self.rows[:s] = self.state.padding_row  # every sequence padding: nothing is written
        static = view_rows(self.decode.static, shape.num_rows)
        host = blank_host(shape.num_rows)

        def step() -> AheadVerdict:
            sampling = (greedy, filters, rule)
            return verify_ahead(self.state, self._logits, self.rows[:s], packed, shape,
                                sampling, host, static)  # fmt: skip

        step()  # eager once: Triton compiles, torch picks its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with undisturbed_capture(graph, self.decode.pool):
            verdict = step()
        self.verifies[key] = (graph, packed, verdict)
