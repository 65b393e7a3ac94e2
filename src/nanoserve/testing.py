"""Tiny random checkpoints for tests, graded stage tests and notebooks.

Introduced in stage 00. Builds a few-layer Llama / Qwen2 / Qwen3 with transformers and saves it
with `save_pretrained`, so nanoserve's own loader reads it like any checkpoint. float64, so two
code paths doing the same arithmetic must agree token for token. Also the server tests' tools: a
real server in a thread, and holds that keep an engine from running ahead of what a test waits
for. Nothing here is used at serve time.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import signal
import threading
from pathlib import Path

import torch

TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TINY_FAMILIES = ("llama", "qwen2", "qwen3")
# per family: (config class, model class, what differs from TINY_SHAPE)
_FAMILY_EXTRAS: dict[str, tuple[str, str, dict[str, object]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # head_dim != hidden / heads
}


def tiny_hf_model(family: str = "llama", seed: int = 0):
    """A random transformers model of the family (2 layers, hidden 64, GQA 4:2), float64, eval."""
    import transformers

    config_name, model_name, extra = _FAMILY_EXTRAS[family]
    config = getattr(transformers, config_name)(**TINY_SHAPE, **extra)
    config._attn_implementation = "eager"  # the plainest arithmetic, for logit comparisons
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).to(torch.float64).eval()


def save_tiny_model(folder: str | Path, family: str = "llama", seed: int = 0) -> str:
    """Save a tiny random checkpoint into folder; returns the folder as a string."""
    tiny_hf_model(family, seed).save_pretrained(folder)
    return str(folder)


# A character tokenizer for the tiny models (stage 10 serves text): one token per character, so
# any id sequence decodes to valid text, and decoding piece by piece gives the whole text.
TINY_CHARS = (
    "\n"
    + "".join(map(chr, range(32, 127)))
    + "".join(c for c in map(chr, range(0xC0, 0x250)) if c.isalpha())
)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A 256-token tokenizer for TINY_SHAPE: 254 characters, then <|im_end|> (254, the EOS) and
    <|im_start|> (255), with a ChatML chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(TINY_CHARS[:254])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=TINY_CHAT_TEMPLATE)
    fast.add_special_tokens(
        {"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]}
    )
    return fast


def save_tiny_chat_model(folder: str | Path, family: str = "llama", seed: int = 0) -> str:
    """A tiny random checkpoint with `tiny_tokenizer()` beside it: text in, text out, in
    milliseconds (its EOS is <|im_end|>). Returns the folder as a string."""
    model = tiny_hf_model(family, seed)
    model.config.eos_token_id, model.config.bos_token_id = 254, 255
    model.generation_config.eos_token_id, model.generation_config.bos_token_id = 254, 255
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


ENGINE_PROMPT_LENGTHS = (1, 3, 4, 5, 8, 9, 17, 60)  # around block boundaries, and one long prompt
ENGINE_MAX_MODEL_LEN = 96


def engine_requests(lengths=ENGINE_PROMPT_LENGTHS, vocab_size: int = 256, seed: int = 0):
    """(prompts, params): random prompts of these lengths; request i asks for 32 + 2i greedy
    tokens, so requests finish at different steps."""
    from nanoserve.sampling import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=32 + 2 * i, ignore_eos=True) for i in range(len(lengths))]
    return prompts, params


def greedy_token_ids(folder: str, stage: int, requests, **engine_options) -> list[list[int]]:
    """Token ids the engine of `stage` generates for (prompts, params) in float64 on the CPU."""
    from nanoserve.llm import LLM

    llm = LLM(folder, stage=stage, device="cpu", dtype="float64", **engine_options)
    prompts, params = requests
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@contextlib.contextmanager
def raises(expected: type[BaseException], call: str):
    """pytest.raises(expected) for a graded test: a failure names the call and what it did."""
    __tracebackhide__ = True  # pytest shows the test's line, not this helper's
    try:
        yield
    except expected:
        return
    except Exception as err:
        raise AssertionError(
            f"{call} raised {type(err).__name__}({err}); expected {expected.__name__}"
        ) from err
    raise AssertionError(f"{call} returned normally; expected it to raise {expected.__name__}")


def assert_num_free(allocator, want: int, when: str) -> None:
    """allocator.num_free_blocks == want; a failure says when, and what it was."""
    __tracebackhide__ = True
    got = allocator.num_free_blocks
    assert got == want, f"{when}: num_free_blocks is {got}, expected {want}"


@torch.inference_mode()
def next_token_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits (V,) after token_ids by a full recompute (stage 00's arithmetic), float32 on CPU."""
    from nanoserve.engine.runner.input_packer import pack_step
    from nanoserve.kernels.attention import NoCacheAttention
    from nanoserve.sampling import SamplingParams
    from nanoserve.types import Sequence

    device = next(model.parameters()).device
    seq = Sequence(token_ids, SamplingParams(max_tokens=1))
    inputs = pack_step([seq], [[]], 1, device, is_prefill=True, from_start=True)
    hidden = model(inputs.input_ids, inputs.positions, NoCacheAttention(), inputs.metadata)
    return model.compute_logits(hidden[-1:])[0].float().cpu()


class RerunGraph:
    """A CPU stand-in for one captured decode graph (stage 08's tests): made once per bucket on
    the views of the static buffers, as a capture is; replay() runs the model again on those same
    views into the same output tensor. Like a graph, it reads only what the buffers hold."""

    def __init__(self, graphs, bucket: int):
        from nanoserve.engine.runner.graph_buffers import view_rows

        self.model, self.attention = graphs.model, graphs.attention
        self.inputs = view_rows(graphs.static, bucket)
        self.output = graphs.outputs[bucket] = self.forward()

    def forward(self) -> torch.Tensor:
        inputs = self.inputs
        return self.model(inputs.input_ids, inputs.positions, self.attention, inputs.metadata)

    def replay(self) -> None:
        self.output.copy_(self.forward())


class ServerThread:
    """A real uvicorn server for tests, in a thread of this process, on a free port of 127.0.0.1.

    `with ServerThread(app) as url:` yields the base URL (`http://127.0.0.1:PORT`) once the server
    listens, and stops it (lifespan shutdown included) on the way out.
    """

    def __init__(self, app, timeout: float = 30):
        from nanoserve.serving.server import make_server

        self.server = make_server(app, "127.0.0.1", port=0, log_level="warning")
        self.timeout = timeout
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> str:
        import time

        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        (sock,) = [s for server in self.server.servers for s in server.sockets][:1]
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout)
        if self.thread.is_alive():
            raise RuntimeError("the test server did not stop")


def held(call, until: threading.Event, when=lambda: True, timeout_s: float = 60):
    """`call` made to wait first, while `when()` is true, until `until` is set (timeout_s at
    most, then it goes on). A server test holds the engine's step with it, so the engine cannot
    run ahead of what the test waits for (a hang-up, a stop) however busy the machine is."""

    def held_call(*args, **kwargs):
        if when():
            until.wait(timeout_s)
        return call(*args, **kwargs)

    return held_call


def signalling(call, event: threading.Event, times: int = 1):
    """`call` made to set `event` once it has returned `times` times: what another thread did,
    for a test to wait on instead of a sleep."""
    num_calls = itertools.count(1)

    def signalling_call(*args, **kwargs):
        result = call(*args, **kwargs)
        if next(num_calls) >= times:
            event.set()
        return result

    return signalling_call


def most_completion_tokens(engine) -> int:
    """The most tokens any running sequence of `engine` has generated (0 when none runs)."""
    return max((seq.num_completion_tokens for seq in engine.scheduler.running), default=0)


def with_default_sigint() -> None:
    """A child's `preexec_fn`: SIGINT back to its default before the child's program starts.

    An ignored signal stays ignored across exec, and Python then keeps it ignored: a test suite
    started where SIGINT is ignored (a shell's background job, some CI runners) would spawn
    children that a Ctrl-C never reaches. A test of what Ctrl-C does sets it back first."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def recorded_releases(scheduler) -> list:
    """Every sequence the scheduler `release`s from now on, in order (it still releases them:
    the next plan tells the runner)."""
    released: list = []
    release = scheduler.release

    def recorded(seq) -> None:
        released.append(seq)
        release(seq)

    scheduler.release = recorded
    return released
