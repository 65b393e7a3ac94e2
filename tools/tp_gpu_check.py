"""Stage 09 on GPUs: TP=1 and TP=2 tokens against stage 08, and a killed worker (run on the H200s).

Usage: PYTHONPATH=src python3 tools/tp_gpu_check.py [tp_size]. Prints, per prompt, how many greedy
tokens agree with stage 08 and, at a first difference, whether each side's token is in stage 08's
top-5 there. Then SIGKILLs a worker mid-run and checks the error, the cleanup and a restart.
"""

import multiprocessing as mp
import os
import signal
import sys
import time

import torch.distributed as dist

from nanoserve import LLM
from nanoserve.bench.workload import make_workload
from nanoserve.parallel.group import WorkerDied
from nanoserve.sampling import SamplingParams
from nanoserve.testing import next_token_logits


def compare(ref_llm, ref, got, label):
    agree = 0
    for i, (a, b) in enumerate(zip(ref, got)):
        n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if n == len(a):
            agree += 1
            continue
        prefix = prompts[i] + a[:n]
        top5 = next_token_logits(ref_llm.model, prefix).topk(5).indices.tolist()
        print(
            f"  {label} prompt {i}: first difference at token {n}/{len(a)}; stage-08 token "
            f"{a[n]}, other {b[n]} in stage 08's top-5: {b[n] in top5}"
        )
    print(f"{label}: {agree}/{len(ref)} identical")


if __name__ == "__main__":
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    work = make_workload(64, 1024, 1024, seed=0)
    prompts = [p[:256] for p in work.prompt_token_ids[:64]]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    opts = dict(max_model_len=2048, gpu_memory_utilization=0.65)  # the first LLM keeps 0.3
    ref_llm = LLM("qwen3-0.6b", stage=8, max_model_len=2048, gpu_memory_utilization=0.3)
    ref = [o.token_ids for o in ref_llm.generate(prompts, greedy, use_tqdm=False)]
    for size in sorted({1, tp}):
        with LLM("qwen3-0.6b", stage=9, tensor_parallel_size=size, **opts) as llm:
            got = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        compare(ref_llm, ref, got, f"stage 9 tp {size} vs stage 8")
    if tp > 1:
        llm = LLM("qwen3-0.6b", stage=9, tensor_parallel_size=tp, **opts)
        worker = llm.engine.runner.workers.processes[0]
        llm.engine.on_step = lambda r: r.step == 20 and os.kill(worker.pid, signal.SIGKILL)
        start = time.perf_counter()
        try:
            llm.generate(prompts, greedy, use_tqdm=False)
            print("fault test: NO ERROR RAISED")
        except WorkerDied as err:
            print(
                f"fault test: WorkerDied after {time.perf_counter() - start:.1f} s: "
                f"{str(err)[:160]}"
            )
        print("after: children", mp.active_children(), "group initialized", dist.is_initialized())
        with LLM("qwen3-0.6b", stage=9, tensor_parallel_size=tp, **opts) as again:
            got = [o.token_ids for o in again.generate(prompts[:8], greedy, use_tqdm=False)]
        print(
            "restart after the fault: first 8 prompts identical to the first tp run:",
            got == ref[:8] or "(compared to stage 8) see above",
        )
