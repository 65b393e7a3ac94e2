"""`--impl` on generate, chat, serve and bench: a learner's stage file runs inside the engine of
its stage, loaded exactly as `nanoserve check` loads it (issue 22, "run your own engine")."""

from __future__ import annotations

import os
import textwrap

import httpx
import pytest
import torch

from nanoserve.check import run_check
from nanoserve.cli import build_parser, main
from nanoserve.stages import STAGES
from nanoserve.testing import ServerThread, save_tiny_chat_model

ENGINE = ["--device", "cpu", "--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "64"]
ENGINE_COMMANDS = ["generate", "chat", "serve", "bench"]


@pytest.fixture(autouse=True)
def threads_restored(monkeypatch):
    """main() sets torch's threads and $OMP_NUM_THREADS for its process: undo it per test."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(before)))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random model with a character tokenizer: text in, text out, in seconds."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def learner_file(tmp_path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


# A learner's stage-03 file: the reference's BlockTable, changed so that it shows it ran.
MY_TABLE = """
    from nanoserve.engine.memory.block_table import BlockPosition, BlockTable as _Reference

    class BlockTable(_Reference):
        def __init__(self, *args, **kwargs):
            print("my BlockTable", flush=True)
            super().__init__(*args, **kwargs)
"""

# A learner's stage-07 file: the reference's manager, without the reference's hit_rate.
MY_PREFIX = """
    from nanoserve.engine.memory.prefix_block_manager import PrefixBlockManager as _Reference
    from nanoserve.engine.memory.prefix_block_manager import chain_hash

    class PrefixBlockManager(_Reference):
        hit_rate = None  # a learner's manager need not keep one
        num_built = 0

        def __init__(self, *args, **kwargs):
            PrefixBlockManager.num_built += 1
            super().__init__(*args, **kwargs)
"""


@pytest.fixture
def no_weights_load(monkeypatch):
    """Loading weights fails the test: --impl must be checked before."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before --impl was checked")

    import nanoserve.recipes.assemble

    monkeypatch.setattr(nanoserve.recipes.assemble, "load_model", refuse)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def one_line_error(argv: list[str], capsys) -> str:
    """What a command said after "error: ", checked to be one line, status 2, no traceback."""
    status, _, err = run(argv, capsys)
    lines = [line for line in err.splitlines() if "error: " in line]
    assert status == 2 and "Traceback" not in err and len(lines) == 1, err
    return lines[0].split("error: ", 1)[1]


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_command_takes_impl_and_defaults_to_the_reference(command):
    args = build_parser().parse_args([command, "--impl", "my_prefix.py"])
    assert args.impl == "my_prefix.py"
    assert build_parser().parse_args([command]).impl is None


def test_generate_runs_your_block_table_and_prints_the_references_tokens(folder, tmp_path, capsys):
    mine = learner_file(tmp_path, "my_table.py", MY_TABLE)
    argv = ["generate", "hello", "--model", folder, "--stage", "3", *ENGINE, "--max-tokens", "6"]
    status, reference, _ = run(argv, capsys)
    assert status == 0 and "my BlockTable" not in reference
    status, yours, err = run([*argv, "--impl", mine], capsys)
    assert status == 0
    assert "my BlockTable" in yours
    assert yours.replace("my BlockTable\n", "") == reference
    assert "BlockTable from my_table.py" in err


def test_a_file_that_fails_to_import_is_the_one_line_nanoserve_check_prints(
    tmp_path, capsys, no_weights_load
):
    broken = learner_file(tmp_path, "my_table.py", "import no_such_module_anywhere\n")
    said = one_line_error(
        ["generate", "hi", "--model", "tiny-llama", "--stage", "3", "--impl", broken], capsys
    )
    assert run_check(3, broken) == 2
    assert capsys.readouterr().err.strip() == f"nanoserve check: {said}"
    assert "failed to import" in said and "line 1 of my_table.py" in said


def test_a_file_missing_an_api_name_is_refused_naming_it(tmp_path, capsys):
    half = learner_file(tmp_path, "my_table.py", "class BlockPosition: pass\n")
    said = one_line_error(["chat", "--model", "tiny-llama", "--stage", "3", "--impl", half], capsys)
    assert said.startswith(f"--impl {half} does not define BlockTable")


@pytest.mark.parametrize(
    ("stage", "names"), [(0, "rms_norm"), (8, "graph_buckets"), (9, "shard_range")]
)
def test_a_stage_graded_on_its_own_says_so_and_names_the_check_command(
    stage, names, capsys, no_weights_load
):
    said = one_line_error(
        ["generate", "hi", "--model", "tiny-llama", "--stage", str(stage), "--impl", "ref"], capsys
    )
    assert names in said and "graded on their own" in said
    assert said.endswith(f"nanoserve check {stage} --impl ref")


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_stage_10s_loop_outside_a_server_points_at_serve(command, capsys):
    argv = [command, "--model", "tiny-llama", "--stage", "10", "--impl", "ref"]
    said = one_line_error(argv, capsys)
    assert "AsyncEngine is a server's loop" in said
    assert "nanoserve serve --stage 10 --impl ref" in said


def test_stage_2s_allocator_runs_in_stage_3s_engine_and_says_so(folder, tmp_path, capsys):
    mine = learner_file(
        tmp_path,
        "my_allocator.py",
        """
        from nanoserve.engine.memory.allocator import BlockAllocator as _Reference, OutOfBlocks

        class BlockAllocator(_Reference):
            def allocate(self, *args, **kwargs):
                print("my allocator", flush=True)
                return super().allocate(*args, **kwargs)
        """,
    )
    argv = ["generate", "hi", "--model", folder, "--stage", "2", *ENGINE, "--max-tokens", "2"]
    status, out, err = run([*argv, "--impl", mine], capsys)
    assert status == 0 and "my allocator" in out
    assert "it runs in stage 03_block_table's engine" in err


def test_the_untouched_starter_stops_at_its_first_task_in_one_line(folder, capsys):
    argv = ["generate", "hi", "--model", folder, "--stage", "7", *ENGINE, "--impl", "starter"]
    status, _, err = run(argv, capsys)
    assert status == 1 and "Traceback" not in err
    assert "error: --impl starter: not implemented yet (task 2: PrefixBlockManager.__init__)" in err


def test_impl_with_tensor_parallel_workers_is_refused_before_loading(capsys):
    argv = ["generate", "hi", "--model", "tiny-llama", "--stage", "7", "--impl", "ref", "-tp", "2"]
    said = one_line_error(argv, capsys)
    assert said.startswith("argument --impl:") and "--tensor-parallel-size" in said


def test_kernels_that_run_only_on_triton_say_how_to_run_them_on_a_cpu(capsys, monkeypatch):
    pytest.importorskip("triton")
    from nanoserve.learner_api import learner_api

    learner_api(5)  # Triton's kernels take the interpreter at import: import them while it is on
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["generate", "hi", "--model", "tiny-llama", "--stage", "5", "--device", "cpu"]
    said = one_line_error([*argv, "--impl", "ref"], capsys)
    assert said.startswith("argument --impl:") and "TRITON_INTERPRET=1" in said
    said = one_line_error([*argv, "--impl", "ref", "--attention-backend", "torch"], capsys)
    assert said.startswith("argument --attention-backend:") and "only on the triton" in said


def test_bench_times_your_engine_under_your_files_name(tmp_path, capsys):
    mine = learner_file(tmp_path, "my_prefix.py", MY_PREFIX)
    argv = ["bench", "--model", "tiny-llama", "--device", "cpu", "--num-seqs", "2"]
    argv += ["--max-input-len", "16", "--max-output-len", "4", "--stage", "7", "--impl", mine]
    status, out, _ = run(argv, capsys)
    assert status == 0 and "nanoserve stage 7 (torch, my_prefix.py)" in out


def test_bench_with_impl_names_one_stage(capsys):
    said = one_line_error(
        ["bench", "--model", "tiny-llama", "--stage", "6,7", "--impl", "ref"], capsys
    )
    assert said.startswith("argument --impl: a learner's file is one stage's")


def serve_once(monkeypatch, argv: list[str], capsys):
    """Run `nanoserve serve` with uvicorn swapped for a test server; one completion, then
    /metrics. Returns (the app, the completion's text, the metrics text)."""
    import nanoserve.serving.server

    seen = {}

    def run_server(app, host, port, log_level):
        with ServerThread(app) as url:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
            seen["completion"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            seen["metrics"] = httpx.get(f"{url}/metrics", timeout=60).text
        seen["app"] = app

    monkeypatch.setattr(nanoserve.serving.server, "run_server", run_server)
    status, out, err = run(["serve", *argv, "--served-model-name", "tiny"], capsys)
    assert status == 0, err
    return seen["app"], seen["completion"]["choices"][0]["text"], seen["metrics"], out


def test_serve_runs_your_async_engine_as_the_servers_loop(folder, tmp_path, monkeypatch, capsys):
    mine = learner_file(
        tmp_path,
        "my_loop.py",
        """
        from nanoserve.serving.async_engine import AsyncEngine as _Reference

        class AsyncEngine(_Reference):
            num_turns = 0

            def run_once(self, commands):
                AsyncEngine.num_turns += 1
                return super().run_once(commands)
        """,
    )
    argv = [folder, "--stage", "10", *ENGINE, "--impl", mine]
    app, text, _, out = serve_once(monkeypatch, argv, capsys)
    loop = app.state.served.loop
    assert (
        type(loop).__name__ == "AsyncEngine"
        and type(loop).__module__ != "nanoserve.serving.async_engine"
    )
    assert type(loop).num_turns > 0 and text
    assert "engine loop in this process" in out


def test_metrics_say_plainly_that_your_prefix_manager_keeps_no_hit_rate(
    folder, tmp_path, monkeypatch, capsys
):
    mine = learner_file(tmp_path, "my_prefix.py", MY_PREFIX)
    _, _, metrics, _ = serve_once(
        monkeypatch, [folder, "--stage", "7", *ENGINE, "--impl", mine], capsys
    )
    assert "\nnanoserve_prefix_cache_hit_rate " not in metrics
    assert (
        "# nanoserve_prefix_cache_hit_rate is not reported: the engine's PrefixBlockManager "
        "(from my_prefix.py) has no hit_rate property"
    ) in metrics
    _, _, metrics, _ = serve_once(monkeypatch, [folder, "--stage", "7", *ENGINE], capsys)
    assert "\nnanoserve_prefix_cache_hit_rate " in metrics and "not reported" not in metrics


def test_bench_serve_hands_your_file_to_the_server_it_starts(tmp_path):
    from nanoserve.bench.serve import serve_command

    args = build_parser().parse_args(["bench", "--serve", "--stage", "10", "--impl", "my_loop.py"])
    command = serve_command(args, 10, "cpu", "float32", 8000)
    assert command[command.index("--impl") + 1] == str((tmp_path.cwd() / "my_loop.py").resolve())


def test_chat_talks_through_your_block_table(folder, tmp_path, monkeypatch, capsys):
    mine = learner_file(tmp_path, "my_table.py", MY_TABLE)
    lines = iter(["hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["chat", "--model", folder, "--stage", "3", *ENGINE, "--max-tokens", "3"]
    status, out, _ = run([*argv, "--impl", mine], capsys)
    assert status == 0 and "my BlockTable" in out and "bot> " in out


# ---- every lesson ends with the command that runs the learner's file in the engine ----


def lesson_run_commands(stage) -> list[list[str]]:
    """The `nanoserve ... --impl` commands of a lesson's last section, each as argv."""
    import re
    import shlex
    from pathlib import Path

    lesson = (Path(__file__).resolve().parents[1] / stage.lesson).read_text()
    last = lesson.split("<!-- --8<-- [end:lesson] -->")[0].rsplit("\n## ", 1)[1]
    fenced = "\n".join(re.findall(r"```bash\n(.*?)```", last, re.S)).replace("\\\n", " ")
    lines = [line.split("#")[0] for line in fenced.splitlines() if "nanoserve " in line]
    argvs = [shlex.split(line.split("nanoserve ", 1)[1]) for line in lines]
    return [argv for argv in argvs if "--impl" in argv]


def check_file_of(stage) -> str | None:
    """The learner's file name the lesson grades with `nanoserve check N --impl FILE`."""
    import re
    from pathlib import Path

    lesson = (Path(__file__).resolve().parents[1] / stage.lesson).read_text()
    found = re.search(rf"nanoserve check {stage.number} --impl (\S+\.py)", lesson)
    return found.group(1) if found else None


@pytest.mark.parametrize("number", range(len(STAGES)))
def test_a_lesson_ends_by_running_your_file_exactly_where_the_engine_can(number):
    from nanoserve.learner_parts import learner_parts
    from nanoserve.stages import get_stage

    stage = get_stage(number)
    try:
        runnable = learner_parts(number, "ref")
    except ValueError:
        runnable = None
    commands = lesson_run_commands(stage)
    if runnable is None:
        assert not commands, f"{stage.lesson} runs --impl where no engine takes the file"
        return
    assert commands, f"{stage.lesson} does not end with the command that runs your file"
    for argv in commands:
        args = build_parser().parse_args(argv)
        assert args.impl == check_file_of(stage), argv  # the file the lesson grades
        assert (args.stage if isinstance(args.stage, int) else args.stage[0][0]) == number


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_impl_without_a_stage_asks_for_one(command, capsys):
    said = one_line_error([command, "--model", "tiny-llama", "--impl", "my_prefix.py"], capsys)
    assert said == (
        "argument --impl: name the stage my_prefix.py is written for, as `nanoserve check` "
        "does: --stage N --impl my_prefix.py"
    )
