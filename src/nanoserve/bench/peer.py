"""The nano-vLLM side of `nanoserve bench --compare nano-vllm`: the peer on the same requests.

Introduced with the peer comparison (after stage 10). nano-vLLM runs the very requests nanoserve
runs, on the weights nanoserve loaded, in a fresh child interpreter each round (its KV cache takes
`gpu_memory_utilization` of the GPU as nanoserve's does, so the two never hold memory at once);
loading and warming up are not timed. It neither installs nor builds nano-vLLM or flash-attn.

    parent (this module)                          child (bench/peer_driver.py, its own process)
    check_peer: nanovllm, flash_attn, CUDA, a     PYTHONPATH = --peer-path : nanoserve's src
      Qwen3 model in 16 bits (ValueError)                      : the parent's PYTHONPATH
    folder (peer_folder.py): what it loads
    request.json ──────── argv ──────────────>  LLM(folder, **engine), warm-up, timed generate
    BenchResult  <─────── result.json ────────  {"output_tokens", "seconds", "preemptions"}
    PeerFailed   <─────── exit status + log ──  a child that fails, dies, or outlives timeout_s
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from importlib.machinery import PathFinder
from pathlib import Path

from nanoserve.bench.peer_folder import PeerFolder, dtype_name
from nanoserve.bench.workload import WARMUP_MAX_TOKENS, WARMUP_PROMPT_LEN, BenchResult, Workload

PEER = "nano-vllm"  # the --compare choice
PEER_TIMEOUT_S = 900.0  # one round: load, capture graphs, run (about a minute on an H200)
PEER_DTYPES = ("bfloat16", "float16")  # what flash-attn computes in
SRC_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds nanoserve/


class PeerFailed(RuntimeError):
    """nano-vLLM's child failed, died or hung; the message says how and ends with its log."""


def is_importable(name: str, peer_path: str | None) -> bool:
    """Whether the child could `import name` (peer_path first on its path); nothing is imported."""
    search = [peer_path] if peer_path else []
    return PathFinder.find_spec(name, [*search, *sys.path]) is not None


def check_peer_path(peer_path: str | None, compare: str | None) -> None:
    """ValueError naming --peer-path unless it is absent, or a folder holding nanovllm/."""
    if peer_path is None:
        return
    if compare != PEER:
        raise ValueError(f"argument --peer-path: it is read by --compare {PEER} only")
    if not (Path(peer_path) / "nanovllm" / "__init__.py").is_file():
        raise ValueError(
            f"argument --peer-path: {peer_path!r} holds no nanovllm/ package; give a nano-vLLM "
            "source checkout, the folder with nanovllm/ in it (e.g. .peer/nano-vllm)"
        )


def missing_requirements(flags, peer_path: str | None) -> list[str]:
    """What this machine or these flags lack for nano-vLLM, each with what to do about it."""
    missing = []
    if not is_importable("nanovllm", peer_path):
        missing.append(
            "the nanovllm package is not importable (pip install "
            "git+https://github.com/GeeeekExplorer/nano-vllm.git, after flash-attn; or pass "
            "--peer-path DIR, a nano-vLLM source checkout)"
        )
    if not is_importable("flash_attn", peer_path):
        missing.append(
            "flash_attn is not importable (pip install flash-attn --no-build-isolation: a "
            "release wheel for your torch, or a build; this project's kit: bash "
            ".peer/build_fa2.sh, then /tmp/fa on PYTHONPATH)"
        )
    if flags.device.type != "cuda":
        missing.append(f"the device is {flags.device.type}, not CUDA (run it on a GPU machine)")
    if flags.model_config.model_type != "qwen3":
        missing.append(
            f"the model is {flags.model_config.model_type}, and nano-vLLM runs Qwen3 only "
            "(use --model qwen3-0.6b or a Qwen3 folder)"
        )
    dtype = dtype_name(flags.dtype)
    if dtype not in PEER_DTYPES:
        missing.append(f"the dtype is {dtype}, and flash-attn needs 16 bits (--dtype bfloat16)")
    return missing


def check_peer(flags, peer_path: str | None) -> None:
    """One ValueError naming --compare that lists all nano-vLLM lacks here, before any load."""
    missing = missing_requirements(flags, peer_path)
    if missing:
        raise ValueError(f"argument --compare: {PEER} cannot run: " + "; ".join(missing))


def peer_engine_options(config) -> dict:
    """nano-vLLM's LLM keywords, from the EngineConfig nanoserve runs with (its block size stays
    256, the one its flash-attn pages take)."""
    return dict(
        enforce_eager=config.enforce_eager,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.tensor_parallel_size,
    )


def peer_request(folder: str, config, workload: Workload) -> dict:
    """What the child runs: the folder, its LLM keywords, the warm-up and the workload."""
    return {
        "model": folder,
        "engine": peer_engine_options(config),
        "temperature": 0.6,
        "warmup": {
            "prompt_token_ids": workload.prompt_token_ids[0][:WARMUP_PROMPT_LEN],
            "max_tokens": WARMUP_MAX_TOKENS,
        },
        "prompt_token_ids": workload.prompt_token_ids,
        "max_tokens": workload.max_tokens,
    }


def child_env(peer_path: str | None) -> dict[str, str]:
    """The child's environment: this one, with the peer and nanoserve's source on PYTHONPATH."""
    paths = [str(Path(peer_path).resolve())] if peer_path else []
    paths += [str(SRC_ROOT), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "PYTHONUNBUFFERED": "1",
    }


def run_peer(
    folder: PeerFolder,
    config,
    workload: Workload,
    peer_path: str | None,
    timeout_s: float = PEER_TIMEOUT_S,
) -> BenchResult:
    """One round of nano-vLLM on the workload in a child process; PeerFailed if it fails."""
    with tempfile.TemporaryDirectory(prefix="nanoserve-peer-run-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps(peer_request(folder.path, config, workload)))
        with open(Path(tmp) / "child.log", "w+") as log:
            command = [sys.executable, "-m", "nanoserve.bench.peer_driver", str(request)]
            exitcode = wait_for_child([*command, str(result)], child_env(peer_path), log, timeout_s)
            if exitcode != 0 or not result.is_file():
                raise PeerFailed(f"{PEER} {exit_words(exitcode, timeout_s)}; {log_tail(log)}")
        record = json.loads(result.read_text())
    eager = "eager" if config.enforce_eager else "graphs"
    ranks = f", tp {config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else ""
    note = f"{folder.note}; block_size 256, engine limits as above"
    return BenchResult(
        f"nano-vLLM (flash-attn, {eager}{ranks})",
        record["output_tokens"],
        record["seconds"],
        record["preemptions"],
        note,
    )


def wait_for_child(command: list[str], env: dict, log, timeout_s: float) -> int | None:
    """Run the child to its end, its output in `log`; its exit status, or None if it was still
    running after timeout_s (then it and any processes it started are killed)."""
    child = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        return child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:  # also on Ctrl-C: its own session does not see the terminal's
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def exit_words(exitcode: int | None, timeout_s: float) -> str:
    """How the child ended, in words."""
    if exitcode is None:
        return f"did not finish in {timeout_s:g} s and was killed"
    if exitcode < 0:
        return f"was killed by signal {-exitcode}"
    if exitcode == 0:
        return "exited without writing its result"
    return f"exited with status {exitcode}"


def log_tail(log, num_lines: int = 20) -> str:
    """The last lines the child wrote, to end an error message with."""
    log.flush()
    log.seek(0)
    lines = log.read().rstrip().splitlines()[-num_lines:]
    return "its last output:\n" + "\n".join(lines) if lines else "it wrote nothing"
