"""What a lossy KV cache costs on a real model: stage 13's e4m3 pool beside the exact pool.

Introduced in stage 13. Runs one model through two attention backends, each over a fresh pool of
its own: stage 04's `TorchPagedAttention` (exact) and stage 13's `TorchFp8Attention` (e4m3
codes). It compares their next-token distributions over a fixed text (KL per position,
perplexity) and their greedy tokens on a few prompts. It measures and decides nothing:
tests/test_fp8_loss.py bounds the numbers, tools/fp8_error_table.py prints them. No engine: block
tables are laid out by hand and each step is packed by the runner's own `pack_rows`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from nanoserve.cache.fp8_pool import Fp8KVPool
from nanoserve.cache.paged import PagedKVPool
from nanoserve.engine.runner.input_packer import pack_rows
from nanoserve.kernels.torch_fp8 import TorchFp8Attention
from nanoserve.kernels.torch_paged import TorchPagedAttention
from nanoserve.llm_arguments import chat_prompt
from nanoserve.types import StepRow

BLOCK_SIZE = 16  # the engine's default
BACKENDS = ("exact", "fp8")  # stage 04's pool and attention; stage 13's

# Written for this measurement (plain English, no quotation): about 400 SmolLM2 tokens.
TEXT = """\
The ferry leaves the harbour at seven every morning, whatever the weather. In summer it carries \
walkers with heavy boots and children who lean over the rail to watch the gulls; in winter it \
carries the post, a few crates of vegetables and the doctor, who visits the island on Tuesdays. \
The crossing takes forty minutes when the sea is calm and closer to an hour when the wind comes \
from the west, because the boat has to turn wide around the rocks at the mouth of the bay.

The captain has made the trip for twenty-two years. She says that the water is never the same \
twice: the tide moves the sandbanks, storms move the buoys, and a channel that was deep in spring \
can be shallow by the autumn. Before each crossing she looks at the sky, reads the forecast and \
talks on the radio with the harbour master, who can see the far side of the bay from his window.

On the island there is one shop, one school with eleven pupils, and a small museum about the \
lighthouse. The lighthouse itself was made automatic long ago, but the keeper's cottage still \
stands beside it, and in the evenings volunteers open it so that visitors can climb the narrow \
stairs and look out across the water toward the mainland. From the top you can count the lights \
of the villages along the coast, and on a clear night you can see the ferry tied up at the \
harbour wall, waiting for the morning.

People who move to the island often say that the hardest thing to learn is patience. Nothing \
arrives on the day it was ordered, a broken window may wait a week for glass, and a storm can \
close the crossing for three days in a row. In return, they say, the evenings are quiet, the \
neighbours know your name, and the sea is always there to look at when the work is done.
"""

# Chat questions for greedy agreement, each answered at some length (a short answer ends early).
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Explain why the sky is blue.",
    "Give three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Describe how a bicycle works.",
    "Why do leaves change color in autumn?",
    "Write a short poem about the sea.",
    "How does a refrigerator keep food cold?",
)


def text_token_ids(tokenizer) -> list[int]:
    """TEXT as token ids, as the engine encodes a prompt (no special tokens added)."""
    return tokenizer.encode(TEXT, add_special_tokens=False)


def prompt_token_ids(tokenizer) -> list[list[int]]:
    """Each of PROMPTS as a chat turn, ending where the assistant's answer begins."""
    turns = [chat_prompt(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    return [tokenizer.encode(turn, add_special_tokens=False) for turn in turns]


def make_attention(kind: str, model, num_blocks: int):
    """A backend of `kind` ("exact" or "fp8") over a fresh pool of num_blocks blocks."""
    config, weight = model.config, model.lm_head.weight
    shape = (num_blocks, BLOCK_SIZE, config.num_hidden_layers, config.num_key_value_heads,
             config.head_dim, weight.dtype, weight.device)  # fmt: skip
    if kind == "fp8":
        return TorchFp8Attention(Fp8KVPool(*shape))
    return TorchPagedAttention(PagedKVPool(*shape))


def lay_out_tables(lengths: list[int]) -> list[list[int]]:
    """Consecutive block ids for sequences of these lengths (tokens), one table each."""
    tables, first = [], 0
    for length in lengths:
        num_blocks = -(-length // BLOCK_SIZE)
        tables.append(list(range(first, first + num_blocks)))
        first += num_blocks
    return tables


@torch.inference_mode()
def run_step(model, attention, rows: list[StepRow], *, is_prefill: bool, every_row=False):
    """Float32 logits of one step: (T, V) at every packed row, or (B, V) at each row's last."""
    step = pack_rows(rows, BLOCK_SIZE, model.lm_head.weight.device, is_prefill=is_prefill)
    hidden = model(step.input_ids, step.positions, attention, step.metadata)
    if not every_row:
        hidden = hidden[step.metadata.cu_seqlens_q[1:].long() - 1]
    return model.compute_logits(hidden).float()


def text_logits(model, kind: str, token_ids: list[int], *, as_decode=False) -> torch.Tensor:
    """(T, V) logits after each token of the text: one prefill, or (as_decode) one token per
    step, as generation writes the cache (each block filled over 16 steps)."""
    (table,) = lay_out_tables([len(token_ids)])
    attention = make_attention(kind, model, len(table))
    if not as_decode:
        rows = [StepRow(token_ids, 0, table)]
        return run_step(model, attention, rows, is_prefill=True, every_row=True)
    logits = [run_step(model, attention, [StepRow(token_ids[:1], 0, table)], is_prefill=True)]
    for p in range(1, len(token_ids)):
        step = [StepRow([token_ids[p]], p, table)]  # token p at position p, context p + 1
        logits.append(run_step(model, attention, step, is_prefill=False))
    return torch.cat(logits)


class TextLoss(NamedTuple):
    """How far one run's next-token distributions are from a reference's over the same text."""

    num_positions: int  # predictions compared: every token of the text but the last
    mean_kl: float  # KL(reference || candidate) in nats, averaged over positions
    max_kl: float
    ppl_reference: float
    ppl_candidate: float
    top1_agreement: float  # the share of positions whose most likely token is the same
    nll_change_sem: float  # standard error of the mean per-position change of -log p(next)

    @property
    def ppl_change(self) -> float:
        """Relative change of perplexity, candidate over reference, minus one."""
        return self.ppl_candidate / self.ppl_reference - 1

    @property
    def ppl_change_noise(self) -> float:
        """One standard error of ppl_change, positions taken as independent: how much a
        different text of this length could move it."""
        return (1 + self.ppl_change) * self.nll_change_sem


def text_loss(reference: torch.Tensor, candidate: torch.Tensor, token_ids: list[int]) -> TextLoss:
    """Compare two (T, V) logits over the same text; the last position predicts nothing."""
    ref = torch.log_softmax(reference[:-1].double(), dim=-1)
    got = torch.log_softmax(candidate[:-1].double(), dim=-1)
    kl = (ref.exp() * (ref - got)).sum(dim=-1)  # (T - 1,)
    targets = torch.tensor(token_ids[1:])[:, None]
    nll_ref, nll_got = (-lp.gather(1, targets)[:, 0] for lp in (ref, got))  # (T - 1,) each
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    ppl_ref, ppl_got = (math.exp(nll.mean().item()) for nll in (nll_ref, nll_got))
    sem = (nll_got - nll_ref).std().item() / math.sqrt(len(targets))
    return TextLoss(len(targets), kl.mean().item(), kl.max().item(), ppl_ref, ppl_got, top1, sem)


class Greedy(NamedTuple):
    """One greedy run of a batch of prompts: per prompt, its tokens and each step's top 5."""

    tokens: list[list[int]]
    top5: list[list[list[int]]]  # [prompt][step] the five most likely tokens at that step


def greedy(model, kind: str, prompts: list[list[int]], num_tokens: int) -> Greedy:
    """num_tokens greedy tokens per prompt (past any end token): one batched prefill, then one
    batched decode step per token, through a backend of `kind`."""
    tables = lay_out_tables([len(p) + num_tokens for p in prompts])
    attention = make_attention(kind, model, sum(map(len, tables)))
    rows = [StepRow(list(p), 0, t) for p, t in zip(prompts, tables)]
    logits = run_step(model, attention, rows, is_prefill=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    top5: list[list[list[int]]] = [[] for _ in prompts]
    for step in range(num_tokens):
        if step:
            # each sequence's newest token, at the position after its prompt and earlier tokens
            rows = [
                StepRow([s[-1]], len(p) + step - 1, t) for p, s, t in zip(prompts, tokens, tables)
            ]
            logits = run_step(model, attention, rows, is_prefill=False)
        for i, best in enumerate(logits.topk(5, dim=-1).indices.tolist()):
            tokens[i].append(best[0])
            top5[i].append(best)
    return Greedy(tokens, top5)


class Agreement(NamedTuple):
    """Greedy tokens of a candidate beside a reference's, each cut after its first end token."""

    num_agreed: list[int]  # per prompt: tokens equal before the first divergence
    num_tokens: list[int]  # per prompt: the reference's tokens
    top5_at_divergence: int  # divergences where each side's token is in the other's top 5

    @property
    def fraction(self) -> float:
        """Tokens agreed before each prompt's first divergence, over all reference tokens."""
        return sum(self.num_agreed) / sum(self.num_tokens)

    @property
    def num_identical(self) -> int:
        """Prompts whose whole completion is the same."""
        return sum(a == n for a, n in zip(self.num_agreed, self.num_tokens))


def agreement(reference: Greedy, candidate: Greedy, end_ids: tuple[int, ...]) -> Agreement:
    """Where the candidate's greedy tokens first leave the reference's, prompt by prompt."""
    agreed, lengths, top5 = [], [], 0
    for i, (want, got) in enumerate(zip(reference.tokens, candidate.tokens)):
        want, got = cut_at_end(want, end_ids), cut_at_end(got, end_ids)
        # equal through an end token means equal lengths: `same` is len(want) only when identical
        same = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        if same < len(want):  # a divergence: the top-5 rule at that step
            top5 += want[same] in candidate.top5[i][same] and got[same] in reference.top5[i][same]
        agreed.append(same)
        lengths.append(len(want))
    return Agreement(agreed, lengths, top5)


def cut_at_end(tokens: list[int], end_ids: tuple[int, ...]) -> list[int]:
    """tokens up to and including the first end token."""
    ends = [j for j, t in enumerate(tokens) if t in end_ids]
    return tokens[: ends[0] + 1] if ends else tokens
