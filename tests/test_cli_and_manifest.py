"""The stage manifest agrees with the repo, and the CLI's subcommands work end to end."""

from pathlib import Path

import pytest

from nanoserve import LLM
from nanoserve.cli import main
from nanoserve.stages import STAGES, get_stage, implemented_stages, latest_stage

from .conftest import needs_smollm2

ROOT = Path(__file__).resolve().parents[1]


def test_manifest_lists_all_fourteen_stages_in_order():
    assert [s.number for s in STAGES] == list(range(14))
    assert [s.stem[:2] for s in STAGES] == [f"{n:02d}" for n in range(14)]


def test_every_reference_module_of_an_implemented_stage_exists():
    for stage in implemented_stages():
        for module in stage.reference_modules:
            assert (ROOT / "src/nanoserve" / module).exists(), (stage.stem, module)


def test_default_llm_stage_is_the_newest_implemented(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    assert LLM(str(folder), device="cpu").stage == latest_stage()


def test_get_stage_rejects_numbers_outside_the_manifest():
    last = len(STAGES) - 1
    with pytest.raises(ValueError, match=rf"0\.\.{last}\b"):
        get_stage(last + 1)


def test_stages_command_prints_every_stage(capsys):
    assert main(["stages"]) == 0
    out = capsys.readouterr().out
    for stage in STAGES:
        assert stage.stem in out


def test_generate_command_reports_a_bad_argument_without_a_traceback(capsys):
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    assert "error: argument --model: model 'no-such-model' is neither" in capsys.readouterr().err


def test_generate_command_rejects_bad_sampling_flags(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "SamplingParams.temperature" in capsys.readouterr().err


@needs_smollm2
@pytest.mark.slow
def test_generate_command_answers_with_smollm2(capsys):
    assert main(["generate", "What is 2 + 2?", "--max-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("> What is 2 + 2?\n")
    assert "tokens, " in out


def test_readme_shows_the_two_commands_first_and_the_manifest_table():
    from nanoserve.stages import markdown_table

    readme = (ROOT / "README.md").read_text()
    assert readme.index("make demo") < readme.index("## Use it")
    assert "make test" in readme
    assert markdown_table() in readme
