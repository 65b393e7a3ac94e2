"""Kernel compiles, counted and kept out of timed runs (issue 31, item 1).

On a CPU the Triton interpreter compiles nothing, so the listener is driven here as Triton drives
it; the GPU tests check the claim itself: after start-up, no request compiles a kernel.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM
from nanoserve.bench.rounds import compile_notes
from nanoserve.bench.workload import BenchResult
from nanoserve.kernels.compile_log import CompileLog
from nanoserve.sampling import SamplingParams

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")


class _Source:
    def __init__(self, name):
        self.name = name


class _Times:
    def __init__(self, microseconds):
        self.total = microseconds


def _compile(name, microseconds, cache_hit=False):
    """What Triton's compiler calls at the end of a build (or a disk-cache load)."""
    knobs.compilation.listener(
        src=_Source(name), metadata={}, metadata_group={}, times=_Times(microseconds),
        cache_hit=cache_hit,
    )  # fmt: skip


def test_the_log_counts_builds_and_disk_cache_loads_while_it_listens_and_no_longer():
    with CompileLog() as log:
        _compile("_prefill_kernel", 600_000)
        _compile("_prefill_kernel", 700_000)
        _compile("_store_kvcache_kernel", 1_000, cache_hit=True)
    assert knobs.compilation.listener is None  # put back as it was
    assert log.available
    assert [k.name for k in log.kernels] == ["_prefill_kernel"] * 2 + ["_store_kvcache_kernel"]
    assert [k.name for k in log.compiled] == ["_prefill_kernel"] * 2  # the load is no build
    assert log.seconds == pytest.approx(1.301)
    assert log.summary() == (
        "3 Triton kernels built in 1.30 s (1 from the disk cache): "
        "_prefill_kernel x2, _store_kvcache_kernel"
    )


def test_a_listener_installed_before_the_log_still_hears_every_compile():
    heard = []
    knobs.compilation.listener = lambda **event: heard.append(event["src"].name)
    try:
        with CompileLog() as log:
            _compile("_decode_reduce_kernel", 10)
    finally:
        restored = knobs.compilation.listener
        knobs.compilation.listener = None
    assert heard == ["_decode_reduce_kernel"] and len(log.kernels) == 1
    assert restored is not None and restored is not log._heard


def _run(engine, startup, timed):
    return BenchResult(engine, 100, 1.0, 0, startup_compile_s=startup, timed_compiles=timed)


def test_bench_notes_give_the_start_up_compile_per_run_and_flag_compiles_inside_the_clock():
    runs = [[_run("stage 11", 4.87, 2), _run("stage 11", 0.02, 0)], [_run("peer", None, None)] * 2]
    assert compile_notes(runs) == [
        "note: stage 11: Triton compile at start-up 4.9 / 0.0 s; 2 kernels compiled inside "
        "the timed runs"
    ]
    quiet = [[_run("stage 11 (interpreter)", 0.0, 0)]]  # nothing compiled: nothing to say
    assert compile_notes(quiet) == []


def test_warm_up_runs_a_request_to_its_end_and_leaves_the_counters_as_they_were(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    llm = LLM(str(folder), stage=11, device="cpu", dtype="float32", block_size=16)
    engine = llm.engine
    engine.warm_up()
    assert not engine.has_unfinished()
    assert (engine.num_steps, engine.num_prefill_tokens) == (0, 0)
    assert engine.manager.num_free_blocks == engine.manager.num_blocks  # all given back


# ---- on a GPU: nothing compiles after start-up ----


@pytest.mark.gpu
@pytest.mark.parametrize("stage, kv_cache_dtype", [(11, "auto"), (13, "fp8")])
def test_after_start_up_no_request_compiles_a_kernel(tiny_checkpoints, stage, kv_cache_dtype):
    folder, _ = tiny_checkpoints["qwen3"]
    llm = LLM(str(folder), stage=stage, device="cuda", dtype="bfloat16", block_size=16,
              max_model_len=512, max_num_seqs=32, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    # prompts of 1 to 300 tokens: block tables 1 to 19 wide (1, 16 and others), batches of
    # 1 to 24 tokens, greedy and sampled rows
    prompts = [[(5 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate([1, 7, 16, 17, 300])]
    with CompileLog() as log:
        for batch in (prompts[:1], prompts, prompts * 4):
            params = [
                SamplingParams(temperature=0.0 if i % 2 else 0.8, ignore_eos=True, max_tokens=9)
                for i in range(len(batch))
            ]
            llm.generate(batch, params, use_tqdm=False)
    torch.cuda.synchronize()
    assert log.available
    assert not log.compiled, log.summary()
