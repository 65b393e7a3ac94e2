"""The `nanoserve` command keeps vLLM's conventions, checks every flag one way before loading a
model, and ends quietly on Ctrl-C or a closed pipe (issue 23)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nanoserve
from nanoserve.cli import build_parser, main
from nanoserve.config import ENGINE_OPTIONS
from nanoserve.engine.memory.kv_manager import PrefixCachingManager
from nanoserve.kernels.backend import BACKEND_NAMES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def threads_restored(monkeypatch):
    """main() sets torch's threads and $OMP_NUM_THREADS for its process: undo it per test."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(before)))
    yield
    torch.set_num_threads(before)


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def engine_group_actions(command: str):
    """The actions of one subcommand's "engine options" group."""
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    group = next(g for g in sub._action_groups if g.title == "engine options")
    return group._group_actions


# vLLM's spellings


def test_serve_takes_the_model_as_a_positional_argument_like_vllm():
    assert parse("serve", "tiny-llama").model == "tiny-llama"
    assert parse("serve", "--model", "tiny-llama").model == "tiny-llama"
    assert parse("serve").model == "smollm2"


def test_serve_with_two_different_models_is_refused_naming_both(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "tiny-llama", "--model", "smollm2")
    err = capsys.readouterr().err
    assert "'tiny-llama'" in err and "'smollm2'" in err


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_boolean_engine_flags_take_no_value_and_have_a_no_form(command):
    assert parse(command, "--enforce-eager").enforce_eager is True
    assert parse(command, "--no-enforce-eager").enforce_eager is False
    assert parse(command).enforce_eager is None  # unset: the engine's default
    assert parse(command, "--enable-prefix-caching").enable_prefix_caching is True
    assert parse(command, "--no-enable-prefix-caching").enable_prefix_caching is False


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_tp_is_short_for_tensor_parallel_size(command):
    assert parse(command, "-tp", "2").tensor_parallel_size == 2


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("dtype", ["auto", "half", "float16", "bfloat16", "float32"])
def test_dtype_takes_vllms_names(command, dtype):
    assert parse(command, "--dtype", dtype).dtype == dtype


def test_vllms_dtype_names_mean_what_they_mean_in_vllm():
    from nanoserve.llm import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("half", cpu) is torch.float16
    assert resolve_dtype("float", cpu) is torch.float32
    assert resolve_dtype("auto", cpu) is torch.float32  # as None: the device's default
    assert resolve_dtype("auto", cuda) is torch.bfloat16


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanoserve {nanoserve.__version__}"
    assert nanoserve.__version__[0].isdigit()


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_every_engine_option_has_help_that_states_its_default(command):
    actions = engine_group_actions(command)
    assert {a.dest for a in actions} >= set(ENGINE_OPTIONS)
    for action in actions:
        assert action.help and "default" in action.help, action.dest


def test_attention_backend_lists_its_choices_in_help():
    (action,) = [a for a in engine_group_actions("generate") if a.dest == "attention_backend"]
    assert tuple(action.choices) == ("auto", *BACKEND_NAMES)
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "{auto,torch,triton,flash_attn}" in help_text


# One validation path: the same words from every command, before any weights load


@pytest.fixture
def no_weights_load(monkeypatch):
    """Loading weights fails the test: every flag must be checked before."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the flags were checked")

    import nanoserve.models.loader
    import nanoserve.recipes.assemble

    monkeypatch.setattr(nanoserve.models.loader, "load_model", refuse)
    monkeypatch.setattr(nanoserve.recipes.assemble, "load_model", refuse)


def error_of(argv: list[str], capsys) -> str:
    """What a command said after "error: " when it refused its flags with status 2."""
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1].split("error: ", 1)[1]


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-num-seqs", "0"],
        ["--gpu-memory-utilization", "1.5"],
        ["--max-model-len", "1000000"],  # past the model's limit
        ["--max-model-len", "200", "--max-num-batched-tokens", "100"],
        ["--attention-backend", "fast"],
        ["--dtype", "float8"],
        ["--device", "gpu"],
        ["--model", "no-such-model"],
        ["--stage", "14"],
        ["--max-num-seqs", "x"],
    ],
)
def test_generate_and_bench_word_a_bad_flag_the_same_way_before_loading_a_model(
    flags, capsys, no_weights_load
):
    model = [] if "--model" in flags else ["--model", "tiny-llama"]
    from_generate = error_of(["generate", "hi", *model, *flags], capsys)
    from_bench = error_of(["bench", *model, *flags], capsys)
    assert from_generate == from_bench
    assert from_generate.startswith(f"argument {flags[-2]}"), from_generate


def test_prefix_caching_before_stage_7_is_refused_naming_the_stage(capsys, no_weights_load):
    said = error_of(
        ["generate", "hi", "--model", "tiny-llama", "--stage", "4", "--enable-prefix-caching"],
        capsys,
    )
    assert said.startswith("argument --enable-prefix-caching") and "stage 7" in said


# enable_prefix_caching, as in vLLM


@pytest.fixture(scope="module")
def folder(tiny_checkpoints):
    return str(tiny_checkpoints["llama"][0])


def prefill_tokens_of_a_repeated_prompt(llm) -> int:
    """Prompt tokens computed for a 40-token prompt asked a second time."""
    from nanoserve import SamplingParams

    prompt, params = list(range(1, 41)), SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    before = llm.engine.num_prefill_tokens
    llm.generate([prompt], params, use_tqdm=False)
    return llm.engine.num_prefill_tokens - before


@pytest.mark.parametrize("enable", [None, True])
def test_prefix_caching_is_on_from_stage_7_unless_turned_off(folder, enable):
    from nanoserve import LLM

    llm = LLM(folder, stage=7, device="cpu", dtype="float64", enable_prefix_caching=enable)
    assert isinstance(llm.engine.manager, PrefixCachingManager)
    assert prefill_tokens_of_a_repeated_prompt(llm) < 40


def test_prefix_caching_turned_off_computes_every_prompt_token_again(folder):
    from nanoserve import LLM

    llm = LLM(folder, stage=7, device="cpu", dtype="float64", enable_prefix_caching=False)
    assert not isinstance(llm.engine.manager, PrefixCachingManager)
    assert prefill_tokens_of_a_repeated_prompt(llm) == 40
    assert llm.config.enable_prefix_caching is False


def test_prefix_caching_asked_of_a_stage_without_one_is_refused(folder):
    from nanoserve import LLM

    with pytest.raises(ValueError, match=r"enable_prefix_caching=True needs stage 7"):
        LLM(folder, stage=4, device="cpu", enable_prefix_caching=True)
    LLM(folder, stage=4, device="cpu", enable_prefix_caching=False)  # nothing to turn off


def test_prefix_caching_off_and_your_own_prefix_manager_are_refused_together(folder):
    from nanoserve import LLM
    from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager

    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        LLM(
            folder,
            stage=7,
            device="cpu",
            enable_prefix_caching=False,
            components={"PrefixBlockManager": PrefixBlockManager},
        )


# Quiet endings and threads


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(capsys, monkeypatch):
    from nanoserve import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "stages", interrupted)
    assert main(["stages"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_a_closed_pipe_ends_a_command_with_141_and_no_traceback():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # like `| head -0`, but closed before the command starts: had it been closed after, a
    # command quick to write its few lines into the pipe's buffer could have exited 0 first
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "nanoserve", "stages"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
        )
    finally:
        os.close(write_end)  # the command's copy is the only one left
    stderr = process.stderr.read().decode()
    assert process.wait(60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr


def test_threads_default_to_leaving_one_cpu_for_the_rest_of_the_machine():
    from nanoserve.options import default_num_threads

    assert default_num_threads(num_cpus=1) == 1
    assert default_num_threads(num_cpus=2) == 1
    assert default_num_threads(num_cpus=16) == 15


def test_threads_flag_sets_torch_threads_and_the_childrens(monkeypatch):
    from nanoserve.options import apply_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert apply_threads(parse("generate", "--threads", "1")) == 1
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_threads_from_omp_num_threads_win_over_the_default(monkeypatch):
    from nanoserve.options import apply_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    try:
        assert apply_threads(parse("bench")) == 3
    finally:
        torch.set_num_threads(before)


def test_ctrl_c_during_a_chat_reply_keeps_what_came_and_returns_to_the_prompt(capsys):
    from nanoserve.cli import chat_reply

    class Interrupted:
        def apply_chat_template(self, history):
            return "prompt"

        def stream(self, prompt, params):
            yield "Paris is"
            raise KeyboardInterrupt

    assert chat_reply(Interrupted(), [], None) == "Paris is"
    assert capsys.readouterr().out == "Paris is [interrupted]\n"


def test_a_chat_reply_cut_by_max_tokens_is_marked(capsys):
    from nanoserve.cli import chat_reply
    from nanoserve.llm import CompletionOutput, RequestOutput

    class Cut:
        def apply_chat_template(self, history):
            return "prompt"

        def stream(self, prompt, params):
            yield "The capital of France"
            return RequestOutput(
                "prompt", [1], [CompletionOutput(0, "The capital of France", [2, 3], "length")]
            )

    assert chat_reply(Cut(), [], None) == "The capital of France"
    assert capsys.readouterr().out == "The capital of France [length]\n"


@pytest.mark.slow
def test_llm_stream_returns_the_finish_reason(smollm2_llm):
    from nanoserve import SamplingParams

    def collect(pieces):
        reason = yield from pieces
        return reason

    text: list[str] = []
    gen = collect(smollm2_llm.stream("Hi", SamplingParams(max_tokens=3, ignore_eos=True)))
    while True:
        try:
            text.append(next(gen))
        except StopIteration as end:
            assert end.value.finish_reason == "length" and len(end.value.token_ids) == 3
            assert end.value.text == "".join(text)
            break
