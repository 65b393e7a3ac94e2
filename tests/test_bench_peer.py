"""`nanoserve bench --compare nano-vllm` and `--repeat` on a CPU: the checks, the child, rounds.

nano-vLLM needs CUDA and flash_attn, so these tests drive the real child process with a fake
`nanovllm` package written to a temporary folder: the request it gets, the result it writes, and
how a child that fails or hangs is reported. Nothing here times anything.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from types import SimpleNamespace

import pytest
import torch

from nanoserve.bench import peer
from nanoserve.bench.peer import PeerFailed, check_peer, missing_requirements, run_peer
from nanoserve.bench.peer_folder import PeerFolder, peer_folder, write_hf_folder
from nanoserve.bench.rounds import run_rounds
from nanoserve.bench.run import run_bench
from nanoserve.bench.workload import BenchResult, make_workload
from nanoserve.config import EngineConfig, engine_config_for
from nanoserve.models.build import checkpoint_state_dict
from nanoserve.models.config import ModelConfig
from nanoserve.models.presets import preset_config, random_model
from tests.test_bench import TINY_RUN, parse, strict_json

FAKE_NANOVLLM = '''
"""A stand-in for nano-vLLM: records what it is asked, generates max_tokens zeros."""
import json, os, time
from pathlib import Path

CALLS = Path(__file__).resolve().parent.parent / "calls.jsonl"


def record(call):
    with open(CALLS, "a") as f:
        f.write(json.dumps(call) + "\\n")


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=64, ignore_eos=False):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class Scheduler:
    def preempt(self, seq):
        pass


class LLM:
    def __init__(self, model, **kwargs):
        if os.environ.get("FAKE_NANOVLLM") == "fail":
            raise RuntimeError("fake nano-vLLM found no CUDA GPU")
        if os.environ.get("FAKE_NANOVLLM") == "hang":
            time.sleep(60)
        self.scheduler = Scheduler()
        record({"init": dict(kwargs, model=model, files=sorted(os.listdir(model)))})

    def generate(self, prompts, sampling_params, use_tqdm=True):
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        params = [vars(p) for p in sampling_params]
        record({"generate": dict(prompts=prompts, params=params, use_tqdm=use_tqdm)})
        self.scheduler.preempt(None)  # one per call: the warm-up's must not be counted
        return [{"text": "", "token_ids": [0] * p.max_tokens} for p in sampling_params]
'''


@pytest.fixture
def fake_peer(tmp_path):
    """A nano-vLLM checkout whose `nanovllm` is the fake above; its calls land in calls.jsonl."""
    checkout = tmp_path / "nano-vllm"
    (checkout / "nanovllm").mkdir(parents=True)
    (checkout / "nanovllm" / "__init__.py").write_text(textwrap.dedent(FAKE_NANOVLLM))
    return checkout


def calls(checkout) -> list[dict]:
    """What the fake nano-vLLM was asked, in order."""
    lines = (checkout / "calls.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def gpu_flags(model_type="qwen3", dtype=torch.bfloat16, device="cuda"):
    """What check_engine_flags returns, as far as the peer's check reads it."""
    config = SimpleNamespace(model_type=model_type)
    return SimpleNamespace(device=torch.device(device), dtype=dtype, model_config=config)


# ---- the options ----


def test_compare_nano_vllm_peer_path_and_repeat_parse():
    args = parse("--compare", "nano-vllm", "--peer-path", "/x/nano-vllm", "--repeat", "3")
    assert (args.compare, args.peer_path, args.repeat) == ("nano-vllm", "/x/nano-vllm", 3)
    assert (parse().peer_path, parse().repeat) == (None, 1)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_repeat_that_is_not_a_positive_count_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit):
        parse("--repeat", value)
    assert "argument --repeat" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--peer-path", "."], "--peer-path"),  # without --compare nano-vllm
        (["--compare", "nano-vllm", "--peer-path", "."], "--peer-path"),  # no nanovllm/ in it
        (["--serve", "--repeat", "2"], "--repeat"),
        (["--serve", "--compare", "nano-vllm"], "--compare"),
    ],
)
def test_peer_and_repeat_options_that_cannot_apply_are_refused_naming_the_option(argv, option):
    with pytest.raises(ValueError, match=f"^argument {option}: "):
        run_bench(parse(*TINY_RUN, *argv))


def test_without_cuda_flash_attn_or_the_peer_the_error_is_one_line_naming_compare(capsys):
    from nanoserve.cli import main

    assert main(["bench", *TINY_RUN, "--compare", "nano-vllm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "nanoserve bench: error: argument --compare: nano-vllm cannot run: "
    )
    for what in ("nanovllm package", "--peer-path DIR", "flash_attn", "device is cpu", "llama"):
        assert what in err, what


def test_a_peer_path_with_nanovllm_and_flash_attn_leaves_only_what_the_machine_lacks(fake_peer):
    (fake_peer / "flash_attn").mkdir()
    (fake_peer / "flash_attn" / "__init__.py").write_text("")
    assert missing_requirements(gpu_flags(), str(fake_peer)) == []
    (cpu,) = missing_requirements(gpu_flags(device="cpu"), str(fake_peer))
    assert "device is cpu, not CUDA" in cpu
    wrong = missing_requirements(gpu_flags("llama", torch.float32), str(fake_peer))
    assert ["Qwen3 only" in wrong[0], "--dtype bfloat16" in wrong[1]] == [True, True]


def test_missing_flash_attn_says_how_to_install_or_build_it(fake_peer):
    with pytest.raises(ValueError, match=r"^argument --compare: .*build_fa2\.sh") as error:
        check_peer(gpu_flags(), str(fake_peer))
    assert "pip install flash-attn --no-build-isolation" in str(error.value)  # a user's machine
    assert "nanovllm" not in str(error.value)  # the fake is found on the peer path


def test_missing_nanovllm_says_where_to_install_it_from():
    if importlib.util.find_spec("nanovllm") is not None:
        pytest.skip("nanovllm is installed on this machine")
    (missing, *_) = missing_requirements(gpu_flags(), None)
    assert "pip install git+https://github.com/GeeeekExplorer/nano-vllm.git" in missing, missing
    assert "--peer-path DIR" in missing, missing


# ---- GPU defaults ----


def qwen3_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(preset_config("qwen3-0.6b"))


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda", 0)])
def test_cuda_gets_nano_vllms_batch_limits(device):
    config = engine_config_for(qwen3_config(), device)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (512, 16384)


def test_a_cpu_keeps_the_small_batch_limits_and_given_limits_always_win():
    config = engine_config_for(qwen3_config(), torch.device("cpu"))
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 8192)
    assert engine_config_for(qwen3_config()) == config  # no device: a CPU's
    given = engine_config_for(qwen3_config(), "cuda", max_num_seqs=256, max_num_batched_tokens=4096)
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (256, 4096)
    long = engine_config_for(qwen3_config(), "cuda", max_model_len=20000)
    assert long.max_num_batched_tokens == 20000  # always room for one whole prompt


def test_the_command_line_resolves_the_cuda_defaults_in_the_same_place(monkeypatch):
    from nanoserve import options

    monkeypatch.setattr(options, "resolve_device", lambda device: torch.device("cuda"))
    flags = options.check_engine_flags(parse("--model", "qwen3-0.6b"), [4])
    assert (flags.config.max_num_seqs, flags.config.max_num_batched_tokens) == (512, 16384)
    flags = options.check_engine_flags(parse("--model", "qwen3-0.6b", "--max-num-seqs", "8"), [4])
    assert flags.config.max_num_seqs == 8


# ---- rounds (their statistics: tests/test_bench_repeat.py) ----


def result(engine: str, seconds: float, note=None) -> BenchResult:
    return BenchResult(engine, 100, seconds, 0, note)


def test_rounds_interleave_every_engine_round_by_round():
    order: list[str] = []

    def runner(name):
        def run():
            order.append(name)
            return result(name, len(order))

        return run

    heard = []
    runs = run_rounds([runner("a"), runner("b"), runner("peer")], 3, lambda n, r: heard.append(n))
    assert order == ["a", "b", "peer"] * 3
    assert [[r.seconds for r in engine_runs] for engine_runs in runs] == [
        [1, 4, 7],
        [2, 5, 8],
        [3, 6, 9],
    ]
    assert heard == [1, 1, 1, 2, 2, 2, 3, 3, 3]

    order.clear()
    runs = run_rounds([runner("a"), runner("b"), runner("peer")], 3, alternate=True)
    assert order == ["peer", "b", "a", "a", "b", "peer", "peer", "b", "a"]
    assert [[r.seconds for r in engine_runs] for engine_runs in runs] == [
        [3, 4, 9],  # each engine's runs still in its own row, in run order
        [2, 5, 8],
        [1, 6, 7],
    ]


# ---- the HF folder nano-vLLM loads ----


def test_the_written_folder_holds_nanoserves_weights_config_and_a_tokenizer(tmp_path):
    import transformers
    from safetensors.torch import load_file

    model = random_model("tiny-llama", "cpu", torch.float64)
    write_hf_folder(model, preset_config("tiny-llama"), tmp_path)
    written = load_file(tmp_path / "model.safetensors")  # what nano-vLLM reads, by these names
    ours = checkpoint_state_dict(model)
    assert set(written) == set(ours) - {"lm_head.weight"}  # tied: the head is the embedding
    for name, tensor in written.items():
        assert torch.equal(tensor, ours[name]), name
    assert transformers.AutoConfig.from_pretrained(tmp_path).dtype == torch.float64
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).eos_token_id == 2


def test_a_folder_with_a_tokenizer_in_the_runs_dtype_is_loaded_as_it_is(tmp_path):
    model = random_model("tiny-llama", "cpu", torch.float32)
    write_hf_folder(model, preset_config("tiny-llama"), tmp_path)
    with peer_folder(str(tmp_path), model, None) as folder:
        assert folder.path == str(tmp_path) and "itself" in folder.note
    with peer_folder(str(tmp_path), model.to(torch.float64), None) as folder:
        assert folder.path != str(tmp_path) and "temporary" in folder.note  # another dtype
    with peer_folder("tiny-llama", model, preset_config("tiny-llama")) as folder:
        written = folder.path
        assert "temporary" in folder.note
    assert not (tmp_path / written).exists()  # removed with the context


# ---- the child ----

WORKLOAD = make_workload(3, 24, 6)
CONFIG = EngineConfig(max_model_len=64, max_num_seqs=5, max_num_batched_tokens=128)


def test_the_child_runs_the_same_requests_with_the_same_limits(fake_peer, tmp_path):
    (tmp_path / "model").mkdir()
    folder = PeerFolder(str(tmp_path / "model"), "loaded here")
    got = run_peer(folder, CONFIG, WORKLOAD, str(fake_peer))
    assert got.output_tokens == sum(WORKLOAD.max_tokens) and got.seconds > 0
    assert got.preemptions == 1 and got.engine == "nano-vLLM (flash-attn, graphs)"
    assert got.note.startswith("loaded here")
    init, warmup, timed = calls(fake_peer)
    assert init["init"] == dict(
        model=str(tmp_path / "model"),
        files=[],
        enforce_eager=False,
        max_model_len=64,
        max_num_seqs=5,
        max_num_batched_tokens=128,
        gpu_memory_utilization=0.9,
        tensor_parallel_size=1,
    )
    assert warmup["generate"]["prompts"] == [WORKLOAD.prompt_token_ids[0][:16]]
    assert timed["generate"]["prompts"] == WORKLOAD.prompt_token_ids
    assert timed["generate"]["use_tqdm"] is False
    expected = [dict(temperature=0.6, max_tokens=m, ignore_eos=True) for m in WORKLOAD.max_tokens]
    assert timed["generate"]["params"] == expected


def test_a_child_that_fails_is_reported_with_its_exit_and_its_last_words(
    fake_peer, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_NANOVLLM", "fail")
    folder = PeerFolder(str(tmp_path), "")
    with pytest.raises(PeerFailed, match="nano-vllm exited with status 1") as error:
        run_peer(folder, CONFIG, WORKLOAD, str(fake_peer))
    assert "fake nano-vLLM found no CUDA GPU" in str(error.value)


def test_a_child_that_hangs_is_killed_at_its_timeout(fake_peer, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NANOVLLM", "hang")
    folder = PeerFolder(str(tmp_path), "")
    with pytest.raises(PeerFailed, match=r"did not finish in 0.5 s and was killed"):
        run_peer(folder, CONFIG, WORKLOAD, str(fake_peer), timeout_s=0.5)


def test_a_child_without_nanovllm_says_so(tmp_path):
    with pytest.raises(PeerFailed, match="No module named 'nanovllm'"):
        run_peer(PeerFolder(str(tmp_path), ""), CONFIG, WORKLOAD, str(tmp_path))


def test_bench_puts_the_peers_median_row_in_the_table_and_every_run_in_json(
    fake_peer, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr("nanoserve.bench.run.check_peer", lambda flags, peer_path: None)
    out_file = tmp_path / "bench.json"
    argv = [*TINY_RUN, "--stage", "4", "--compare", "nano-vllm", "--peer-path", str(fake_peer)]
    assert run_bench(parse(*argv, "--repeat", "2", "--json", str(out_file))) == 0
    out = capsys.readouterr().out
    assert out.count("round 1/2: ") == 2 and out.count("round 2/2: ") == 2
    assert "nano-vLLM (flash-attn, graphs)" in out and "temporary folder" in out
    assert "nanoserve stage 4 (torch): 2 runs, tok/s" in out
    report = strict_json(out_file.read_text())
    ours, theirs = report["results"]
    assert [len(ours["runs"]), len(theirs["runs"])] == [2, 2]
    asked = sum(WORKLOAD.max_tokens)
    assert [r["output_tokens"] for r in theirs["runs"]] == [asked, asked]
    assert report["options"]["repeat"] == 2
    init = next(c["init"] for c in calls(fake_peer) if "init" in c)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(init["files"])
    assert (init["max_num_seqs"], init["max_num_batched_tokens"]) == (64, 8192)  # the header's
    assert "max_num_seqs 64, max_num_batched_tokens 8192" in out
    assert report["options"]["compare"] == peer.PEER
