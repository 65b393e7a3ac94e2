"""`nanoserve bench`: the workload is nano-vLLM's, the options are checked, a tiny run compares.

Nothing here times anything: the numbers the benchmark prints are never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import pytest
import torch

import nanoserve
from nanoserve.bench.arguments import add_bench_parser, checked_stages
from nanoserve.bench.clients import Timing
from nanoserve.bench.run import run_bench
from nanoserve.bench.workload import BenchResult, make_workload
from nanoserve.models.build import checkpoint_state_dict
from nanoserve.models.config import ModelConfig
from nanoserve.models.presets import PRESETS, preset_config, random_model
from nanoserve.stages import latest_stage

TINY_RUN = [
    "--model",
    "tiny-llama",
    "--device",
    "cpu",
    "--num-seqs",
    "3",
    "--max-input-len",
    "24",
    "--max-output-len",
    "6",
]


def parse(*argv: str) -> argparse.Namespace:
    """The bench options as the `nanoserve` CLI parses them."""
    parser = argparse.ArgumentParser(prog="nanoserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_full_workload_is_nano_vllms_133966_output_tokens():
    workload = make_workload()
    assert len(workload.prompt_token_ids) == len(workload.max_tokens) == 256
    assert sum(workload.max_tokens) == 133_966
    assert sum(len(p) for p in workload.prompt_token_ids) == 142_827


def test_workload_is_the_same_on_every_call():
    assert make_workload(16, 256, 64) == make_workload(16, 256, 64)


def test_scaled_workload_keeps_lengths_and_ids_in_their_ranges():
    workload = make_workload(num_seqs=16, max_input_len=256, max_output_len=64)
    assert len(workload.prompt_token_ids) == 16
    assert all(100 <= len(p) <= 256 for p in workload.prompt_token_ids)
    assert all(1 <= m <= 64 for m in workload.max_tokens)  # a maximum below 100 starts at 1
    assert all(0 <= t <= 10_000 for p in workload.prompt_token_ids for t in p)


def test_small_vocabularies_get_the_ids_folded_into_range():
    workload = make_workload(4, 64, 8)
    folded = workload.fold_ids(512)
    assert all(0 <= t < 512 for p in folded.prompt_token_ids for t in p)
    assert [len(p) for p in folded.prompt_token_ids] == [len(p) for p in workload[0]]
    assert workload.fold_ids(49152) == workload


def test_stage_option_takes_comma_lists_and_repeats():
    assert checked_stages(parse("--stage", "1,4", "--stage", "3", "--stage", "4")) == [1, 4, 3]


def test_presets_have_the_real_models_shapes():
    qwen = ModelConfig.from_hf_dict(preset_config("qwen3-0.6b"))
    assert (qwen.model_type, qwen.num_hidden_layers, qwen.head_dim, qwen.qk_norm) == (
        "qwen3",
        28,
        128,
        True,
    )
    assert qwen.eos_token_ids == (151645,) and qwen.tie_word_embeddings
    smol = ModelConfig.from_hf_dict(preset_config("smollm2-135m"))
    assert (smol.hidden_size, smol.num_key_value_heads, smol.vocab_size) == (576, 3, 49152)
    llama = ModelConfig.from_hf_dict(preset_config("llama-3.2-1b"))
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_theta == 500000.0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_transformers_reads_each_preset_as_the_same_shape(name):
    import transformers

    hf_config = transformers.AutoConfig.for_model(**preset_config(name))
    theirs = ModelConfig.from_hf_dict(hf_config.to_dict())
    ours = ModelConfig.from_hf_dict(preset_config(name))
    if ours.rope_scaling:  # transformers 5 folds rope_theta into its copy of the scaling dict
        assert {**ours.rope_scaling, "rope_theta": ours.rope_theta} == theirs.rope_scaling
        theirs = dataclasses.replace(theirs, rope_scaling=ours.rope_scaling)
    assert theirs == ours


def test_random_weights_are_small_seeded_and_leave_norms_at_one():
    model = random_model("tiny-llama", "cpu", torch.float32, seed=3)
    again = random_model("tiny-llama", "cpu", torch.float32, seed=3)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    assert torch.all(model.model.norm.weight == 1)
    std = model.model.layers[0].mlp.gate_up_proj.weight.std().item()
    assert 0.015 < std < 0.025
    other = random_model("tiny-llama", "cpu", torch.float32, seed=4)
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_transformers_twin_of_a_preset_has_nanoserves_weights():
    from nanoserve.bench.hf import hf_twin

    model = random_model("tiny-llama", "cpu", torch.float64)
    twin = hf_twin("tiny-llama", model, torch.device("cpu"), torch.float64)
    theirs = twin.state_dict()
    for name, tensor in checkpoint_state_dict(model).items():
        assert torch.equal(tensor, theirs[name]), name


def test_tiny_bench_compares_nanoserve_with_transformers(tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    assert run_bench(parse(*TINY_RUN, "--compare", "hf", "--json", str(out_file))) == 0
    out = capsys.readouterr().out
    assert f"nanoserve stage {latest_stage().number}" in out  # the default: the newest stage
    assert "transformers generate (padded)" in out
    assert "1.00x" in out and "only those are counted" in out
    report = strict_json(out_file.read_text())
    asked = sum(make_workload(3, 24, 6).max_tokens)
    assert [r["output_tokens"] for r in report["results"]] == [asked, asked]
    assert report["results"][0]["ratio"] == 1.0 and report["results"][1]["ratio"] > 0
    assert report["version"] == nanoserve.__version__
    assert report["commit"] is None or len(report["commit"]) == 40
    assert report["device"]["type"] == "cpu" and report["device"]["torch_threads"] >= 1
    assert datetime.datetime.fromisoformat(report["timestamp"]).tzinfo is not None


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as JSON.parse does."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


# a request of 4 tokens in 3 chunks sent at 0 s, and one of 1 token sent at 1 s
TIMINGS = [
    Timing(sent=0.0, token_times=[0.1, 0.2, 0.4], token_counts=[1, 1, 2], done=0.45),
    Timing(sent=1.0, token_times=[1.5], token_counts=[1], done=1.6),
]


def test_served_latencies_are_numbers_in_ms_with_a_record_per_request():
    from nanoserve.bench.report import latency_report

    report = latency_report(TIMINGS)
    first, second = report["requests"]
    assert first == pytest.approx(
        dict(sent_ms=0, output_tokens=4, ttft_ms=100, tpot_ms=350 / 3, e2e_ms=450)
    )
    assert second["tpot_ms"] is None and second["sent_ms"] == pytest.approx(1000)
    latency = report["latency_ms"]
    assert latency["ttft"] == pytest.approx(dict(mean=300, p50=300, p90=460, p99=496))
    assert latency["itl"] == pytest.approx(dict(mean=100, p50=100, p90=100, p99=100))
    assert latency["tpot"]["p50"] == pytest.approx(350 / 3)
    assert latency["e2e"]["mean"] == pytest.approx(525)


def test_a_served_report_with_an_unbounded_rate_is_strict_json(tmp_path):
    from nanoserve.bench.report import bench_report, write_json
    from nanoserve.bench.rounds import summarize

    served = summarize([BenchResult("served", 5, 0.0, None)])  # zero seconds: infinite tokens/s
    report = bench_report(parse("--serve"), ["header"], [10], [served], None, TIMINGS)
    write_json(str(tmp_path / "bench.json"), report)
    loaded = strict_json((tmp_path / "bench.json").read_text())
    assert loaded["options"]["request_rate"] is None  # inf: every request at once
    assert loaded["results"][0]["tokens_per_s"] is None and loaded["device"] is None
    assert len(loaded["requests"]) == 2


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--stage", "14"], "--stage"),  # past the manifest
        (["--model", "no-such-model"], "--model"),
        (["--device", "gpu"], "--device"),
        (["--max-model-len", "16"], "--max-model-len"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--stage", "11,12", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),  # stage 13's
    ],
)
def test_bad_options_raise_an_error_naming_the_option(argv, option):
    with pytest.raises(ValueError, match=f"^argument {option}: "):
        run_bench(parse(*TINY_RUN, *argv))


@pytest.mark.parametrize("argv", [["--num-seqs", "0"], ["--stage", "1,x"], ["--compare", "vllm"]])
def test_malformed_options_are_refused_by_the_parser_naming_the_option(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert f"argument {argv[0]}" in capsys.readouterr().err


def test_a_shared_prefix_replaces_the_start_of_every_prompt_and_keeps_the_rest():
    from nanoserve.bench.workload import with_shared_prefix

    workload = make_workload(8, 200, 16)
    shared = with_shared_prefix(workload, 50)
    heads = {tuple(p[:50]) for p in shared.prompt_token_ids}
    assert len(heads) == 1
    for before, after in zip(workload.prompt_token_ids, shared.prompt_token_ids):
        assert len(after) == len(before) and after[50:] == before[50:]
    assert shared.max_tokens == workload.max_tokens


@pytest.mark.parametrize(
    ("flag", "saves"), [("--enable-prefix-caching", True), ("--no-enable-prefix-caching", False)]
)
def test_bench_runs_stage_7_with_prefix_caching_on_or_off_as_asked(flag, saves, tmp_path):
    out_file = tmp_path / "bench.json"
    prefix = ["--shared-prefix", "8", "--block-size", "4", "--max-num-seqs", "1"]  # prompts 10+
    argv = [*TINY_RUN, "--stage", "7", *prefix, flag]
    assert run_bench(parse(*argv, "--json", str(out_file))) == 0
    (result,) = strict_json(out_file.read_text())["results"]
    prompt_tokens = sum(len(p) for p in make_workload(3, 24, 6).prompt_token_ids)
    assert (result["prefill_tokens"] < prompt_tokens) == saves


def test_stage13_fp8_runs_beside_a_stage_that_keeps_the_models_dtype(capsys):
    """--kv-cache-dtype fp8 reaches the stages that have an e4m3 pool; a stage before 13 runs
    beside it on its own dtype, so one table compares them (as tp does for a stage before 09)."""
    assert run_bench(parse(*TINY_RUN, "--stage", "11,13", "--kv-cache-dtype", "fp8")) == 0
    out = capsys.readouterr().out
    assert "nanoserve stage 11 (torch)" in out and "nanoserve stage 13 (torch, kv fp8)" in out


def test_the_workload_steps_tool_splits_a_run_whose_steps_add_up_to_it(tmp_path):
    """tools/workload_steps.py (a measuring tool for docs/benchmarks.md) still runs: on a tiny
    model, its groups count every step once and the steps' seconds add up to the run's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "steps.jsonl"
    command = [sys.executable, str(root / "tools/workload_steps.py"), "--model", "tiny-llama",
               "--device", "cpu", "--num-seqs", "5", "--max-input-len", "24",
               "--max-output-len", "10", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "TRITON_INTERPRET": "1"}
    printed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    lines = printed.stdout.splitlines()
    steps = [json.loads(line) for line in out.read_text().splitlines()]
    run = float(lines[1].split()[1])  # "run 0.115 s, 11 steps; ..."
    assert lines[1].split()[3] == str(len(steps))
    groups = [line.split() for line in lines[3:] if not line.startswith("all")]
    assert groups[0][0] == "prefill" and all(g[0] in ("prefill", "decode") for g in groups)
    assert sum(int(g[-9]) for g in groups) == len(steps)  # every step in one group
    assert sum(s["seconds"] for s in steps) == pytest.approx(run, abs=2e-3)
    assert sum(s["tokens"] for s in steps if not s["prefill"]) == sum(
        int(g[-8]) for g in groups if g[0] == "decode"
    )


@pytest.mark.slow  # a compiler in a child process: make test runs it, make check not
def test_the_kernel_sass_tool_compiles_the_fp8_decode_kernel_with_under_one_conversion_a_code():
    """tools/kernel_sass.py (a measuring tool for docs/benchmarks.md) compiles the paged decode
    kernel for sm_90 on a CPU. A tile of 64 keys x 128 of K and of V over 4 warps is 128 codes a
    thread; converting each straight to bfloat16 took 1.5 conversion instructions a code, which
    Hopper issues at 16 a clock per SM. The kernel must keep under one a code."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "tools/kernel_sass.py"), "--block-n", "64"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not run
    env["PYTHONPATH"] = str(root / "src")
    printed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in printed.stdout.splitlines() if line.startswith("| ")]
    table = [dict(zip([h.strip() for h in rows[0]], [c.strip() for c in row])) for row in rows[1:]]
    pools = {row["pool"]: row for row in table}
    assert set(pools) == {"bfloat16", "e4m3"}
    assert int(pools["e4m3"]["mma"]) == int(pools["bfloat16"]["mma"]) > 0  # the same two dots
    codes_per_thread = 2 * 64 * 128 // (4 * 32)
    assert 0 < int(pools["e4m3"]["cvt"]) < codes_per_thread
    for row in table:  # the loop's body, found: a large part of the kernel, never all of it
        assert int(row["instructions"]) // 3 < int(row["loop"]) < int(row["instructions"])


def test_the_decode_variants_patch_applies_and_v_laid_out_by_key_reads_the_same_values(tmp_path):
    """tools/variants/fp8_decode.patch (measured by tools/bench_fp8_decode.py --variants) still
    applies to src/, and its `vt` kernel, reading V's codes laid out (block, KV head, D, token),
    gives the committed kernel's output bit for bit: over contexts that end inside a block (one
    stale, finite code past the end), exactly at a block's end, and at 1 token; its store
    writes the committed store's codes in that layout (runs, then larger values that requantize
    the older codes); `s16`, the store with one-token runs built for 16 rows, writes the
    committed store's codes; and `r128` caps the e4m3 decode kernel's registers only."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "variants"
    shutil.copytree(root / "src", copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    patch = root / "tools/variants/fp8_decode.patch"
    applied = subprocess.run(["git", "apply", "-p1", f"--directory={copy.name}", str(patch)],
                             cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert applied.returncode == 0, f"the patch no longer applies to src/: {applied.stderr}"
    script = """
import torch
from nanoserve.kernels import paged_decode
torch.manual_seed(0)
shape = (12, 16, 2, 32)  # blocks, block size, KV heads, D
codes = lambda: (torch.randint(0, 0x7F, shape) | torch.randint(0, 2, shape) << 7).to(torch.uint8)
k, v = codes(), codes()
by_key = v.permute(0, 2, 3, 1).contiguous().view(shape)
scales = dict(k_scales=torch.randint(-8, 1, (12, 2), dtype=torch.int32),
              v_scales=torch.randint(-8, 1, (12, 2), dtype=torch.int32))
q = torch.randn(3, 4, 32)
tables = torch.tensor([[3, 7, 1, 9], [5, 2, 11, 0], [4, 6, 8, 10]], dtype=torch.int32)
lens = torch.tensor([37, 32, 1], dtype=torch.int32)
want = paged_decode.paged_attention_decode(q, k, v, lens, tables, 0.25, block_n=32, **scales)
paged_decode._VARIANTS.add("vt")
got = paged_decode.paged_attention_decode(q, k, by_key, lens, tables, 0.25, block_n=32, **scales)
assert torch.equal(got, want), (got - want).abs().max()
from nanoserve.kernels.store_fp8 import store_kvcache_fp8  # the store writes V by key under vt
slots = torch.tensor([4, 5, 6, 9, 10, -1, 20, 21, 22, 23, 24, 13], dtype=torch.int32)  # runs
def store(vt):
    paged_decode._VARIANTS.discard("vt")
    paged_decode._VARIANTS.update(["vt"] if vt else [])
    pool = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2)]
    exps = dict(k_scales=torch.full((12, 2), -64, dtype=torch.int32),
                v_scales=torch.full((12, 2), -64, dtype=torch.int32))
    torch.manual_seed(1)
    for n, slot_mapping, size in ((12, slots, 1), (3, torch.tensor([7, 11, 25]), 4)):
        kv = [torch.randn(n, 2, 32) * size for _ in range(2)]  # then larger: codes requantized
        store_kvcache_fp8(*kv, *pool, slot_mapping.to(torch.int32), **exps)
    return pool
by_token, by_key = store(False), store(True)
assert torch.equal(by_key[0], by_token[0])
assert torch.equal(by_key[1], by_token[1].permute(0, 2, 3, 1).contiguous().view(shape))
paged_decode._VARIANTS.add("s16")  # every run built for 16 rows: the same codes and exponents
assert all(torch.equal(a, b) for a, b in zip(store(False), by_token))
paged_decode._VARIANTS.add("r128")  # a register cap for the e4m3 kernel only (a GPU's option)
assert paged_decode._register_cap(True) == {"maxnreg": 128}
assert paged_decode._register_cap(False) == {}
print("same")
"""
    env = {**os.environ, "PYTHONPATH": str(copy), "TRITON_INTERPRET": "1"}
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert ran.returncode == 0 and ran.stdout.strip() == "same", ran.stderr[-2000:]


def test_variant_rounds_runs_the_committed_kernels_and_a_variant_in_turn_and_compares_medians(
    capsys,
):
    """tools/variant_rounds.py: one `nanoserve bench` process per engine and round, the variant's
    with NANOSERVE_FP8_VARIANTS set (on the committed tree the variable is read by nothing, so
    both are the same engine here), and a summary of medians with every round's ratio."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "variant_rounds", root / "tools/variant_rounds.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit):
        tool.main(["--variant", "vt", "--rounds", "2", "--", "--model", "tiny-llama"])
    assert "must be odd" in capsys.readouterr().err
    bench = ["--model", "tiny-llama", "--device", "cpu", "--num-seqs", "2", "--max-input-len", "8",
             "--max-output-len", "4", "--stage", "13", "--kv-cache-dtype", "fp8"]  # fmt: skip
    tool.main(["--variant", "vt", "--rounds", "1", "--tree", str(root / "src"), "--", *bench])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].split(",")[-1].strip() for line in lines[:2]] == ["committed", "vt"]
    assert lines[2].startswith("nanoserve stage 13") and "(medians of 1)" in lines[2]
    committed, variant = (
        float(line.split(": ")[-1].split()[0].replace(",", "")) for line in lines[:2]
    )
    of_medians, rounds = lines[2].split("(medians of 1): ")[1].split("x; rounds ")
    assert abs(float(of_medians) - variant / committed) < 2e-3 and rounds == of_medians
