"""Stage 09 on CPU processes over gloo: TP=2 generates what TP=1 does, and failures clean up.

Every engine here has real worker processes and a real process group. Models are float64, so the
sharded sums (a different order of additions) cannot flip a greedy token.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.synchronize import SemLock
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanoserve import LLM
from nanoserve.parallel.group import WorkerDied
from nanoserve.sampling import SamplingParams
from nanoserve.testing import engine_requests, with_default_sigint

CPU = dict(device="cpu", dtype="float64", kv_cache_bytes=2**24, max_model_len=512)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tiny_sharded_model(
    folder: Path, family: str, vocab_size: int, heads: int, kv_heads: int, **extra
) -> str:
    """A tiny float64 checkpoint with a chosen head split and vocabulary, saved for the loader."""
    import transformers

    kinds = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    config = getattr(transformers, f"{kinds[family]}Config")(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=512,
        **extra,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{kinds[family]}ForCausalLM")(config).to(torch.float64)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True, scope="module")
def nothing_left_behind():
    """After every test here: no worker process, no process group, no new shared memory.

    Another pytest-xdist worker runs beside this one and makes semaphores of its own, so only
    the semaphores this process made count, and an entry counts only if it stays: a neighbour's
    test ends, a leak does not."""
    shm_before = new_shm(set())
    made: list[str] = []  # the semaphore names this process makes
    original = SemLock.__dict__["_make_name"]

    def recording_make_name() -> str:
        made.append(name := original.__func__())
        return name

    SemLock._make_name = staticmethod(recording_make_name)
    try:
        yield
    finally:
        SemLock._make_name = original
    assert mp.active_children() == []
    assert not dist.is_initialized()
    ours = {"sem." + name.lstrip("/") for name in made}
    left = {e for e in new_shm(shm_before) if not e.startswith("sem.") or e in ours}
    deadline = time.monotonic() + 30
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left &= new_shm(shm_before)
    assert left == set()


def new_shm(before: set[str]) -> set[str]:
    """Entries of /dev/shm that were not there before (semaphores, shared memory)."""
    return (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) - before


def generate(model: str, stage: int, tp: int, requests, **options):
    with LLM(model, stage=stage, tensor_parallel_size=tp, **{**CPU, **options}) as llm:
        outputs = llm.generate(*requests, use_tqdm=False)
        workers = llm.engine.runner.workers
        return [o.token_ids for o in outputs], workers


@pytest.mark.parametrize(
    ("family", "vocab_size", "heads", "kv_heads", "extra"),
    [
        ("llama", 515, 8, 2, {"tie_word_embeddings": False}),  # 4 queries per KV head, odd vocab
        ("qwen2", 256, 4, 4, {"tie_word_embeddings": True}),  # no GQA, q/k/v bias, tied head
        ("qwen3", 300, 4, 2, {}),  # q/k norms, GQA 2:1
    ],
    ids=["llama-gqa4-vocab515", "qwen2-bias-tied", "qwen3-qknorm"],
)
def test_two_ranks_generate_the_tokens_of_one(tmp_path, family, vocab_size, heads, kv_heads, extra):
    model = tiny_sharded_model(tmp_path, family, vocab_size, heads, kv_heads, **extra)
    requests = engine_requests(lengths=(5, 17, 33, 9), vocab_size=vocab_size)
    one, _ = generate(model, 8, 1, requests)
    two, _ = generate(model, 9, 2, requests)
    assert two == one


def test_stage_9_at_one_rank_is_stage_8(tmp_path):
    model = tiny_sharded_model(tmp_path, "llama", 256, 4, 2)
    requests = engine_requests(lengths=(7, 30), vocab_size=256)
    assert generate(model, 9, 1, requests)[0] == generate(model, 8, 1, requests)[0]


def test_a_control_message_over_one_mebibyte_goes_through():
    # 1,400 prompts of 250 ids in 256..511 prefill in one step: pickled at 3 bytes an id, the
    # step's rows are ~1.05 MB, past nano-vLLM's fixed 1 MiB buffer
    prompts = [[256 + (i * 7 + j) % 256 for j in range(250)] for i in range(1400)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    options = dict(max_num_seqs=1400, max_num_batched_tokens=1400 * 250, kv_cache_bytes=2**29)
    two, workers = generate("tiny-llama", 9, 2, (prompts, params), dtype="float32", **options)
    assert workers.largest_message_bytes > 2**20
    some = [0, 1, 700, 1399]  # the same next token as one rank gives them
    one, _ = generate("tiny-llama", 8, 1, ([prompts[i] for i in some], params), dtype="float32")
    assert [two[i] for i in some] == one


def test_a_size_that_does_not_split_the_kv_heads_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide num_key_value"):
        LLM("tiny-llama", stage=9, tensor_parallel_size=4, **CPU)  # 2 KV heads
    assert mp.active_children() == []


def test_stages_before_9_refuse_several_ranks():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs stage 9"):
        LLM("tiny-llama", stage=8, tensor_parallel_size=2, **CPU)


def test_a_killed_worker_fails_the_call_clearly_and_a_new_engine_starts():
    prompts, params = engine_requests(lengths=(5, 9, 14), vocab_size=512)
    llm = LLM("tiny-llama", stage=9, tensor_parallel_size=2, **CPU)
    worker = llm.engine.runner.workers.processes[0]

    def kill_at_step_3(record):
        if record.step == 3:
            os.kill(worker.pid, signal.SIGKILL)

    llm.engine.on_step = kill_at_step_3
    with pytest.raises(WorkerDied, match=r"worker 1 .* killed by signal 9"):
        llm.generate(prompts, params, use_tqdm=False)
    assert not worker.is_alive() and not dist.is_initialized()
    assert llm.engine.scheduler.is_finished()  # the call's requests were aborted
    with pytest.raises(WorkerDied, match="shut down"):  # the engine says so, it does not hang
        llm.generate(prompts, params, use_tqdm=False)
    again, _ = generate("tiny-llama", 9, 2, (prompts, params))
    assert again == generate("tiny-llama", 8, 1, (prompts, params))[0]


def run_script(body: str, tmp_path: Path, *args: str, interrupt_after: str | None = None) -> str:
    """Run body in a fresh interpreter; with interrupt_after, send SIGINT once it prints that."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=with_default_sigint,  # a Ctrl-C reaches it however the suite was started
    )
    lines = []
    hung = threading.Event()  # a child that never ends fails the test instead of hanging the suite
    watchdog = threading.Timer(SCRIPT_DEADLINE_S, lambda: (hung.set(), proc.kill()))
    watchdog.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if interrupt_after and line.startswith(interrupt_after):
                proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        watchdog.cancel()
    printed = "".join(lines)
    assert not hung.is_set(), f"the script ran past {SCRIPT_DEADLINE_S} s; it printed:\n{printed}"
    return printed


SCRIPT_DEADLINE_S = 600  # far past a slow machine's run (tens of seconds): only a hang reaches it


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.parametrize("ending", ["normal exit", "ctrl-c mid-generate"])
def test_exit_and_ctrl_c_leave_no_worker_behind(tmp_path, ending):
    out = run_script(
        """
        import sys
        import time
        from nanoserve import LLM
        from nanoserve.sampling import SamplingParams

        def on_step(record):
            print("step", record.step, flush=True)
            if record.step == 5 and sys.argv[2:] == ["wait"]:
                time.sleep(60)  # Ctrl-C lands here, mid-generate, however slow the reader is

        if __name__ == "__main__":
            llm = LLM("tiny-llama", stage=9, tensor_parallel_size=2, device="cpu",
                      dtype="float64", kv_cache_bytes=2**24)
            print("workers", *[p.pid for p in llm.engine.runner.workers.processes], flush=True)
            llm.engine.on_step = on_step
            params = SamplingParams(max_tokens=int(sys.argv[1]), ignore_eos=True)
            try:
                llm.generate([[1, 2, 3]] * 4, params, use_tqdm=False)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
        """,
        tmp_path,
        *(["400", "wait"] if ending == "ctrl-c mid-generate" else ["8"]),
        interrupt_after="step 5" if ending == "ctrl-c mid-generate" else None,
    )
    pids = [int(p) for p in out.split("workers", 1)[1].split("\n", 1)[0].split()]
    assert pids and pids_alive(pids) == []
    assert ("interrupted" in out) == (ending == "ctrl-c mid-generate")
