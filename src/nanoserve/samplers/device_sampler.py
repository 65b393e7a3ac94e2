"""The device sampler: every row's next token drawn on the device, with no host loop and no sync.

Written for stage 11 (overlap scheduling), where step N + 1 is launched before step N's tokens
reach the host, so sampling must be one batch of tensor ops over per-row tensors. It does what
`sampling.Sampler` does (greedy, temperature, top-k, top-p, per-request seeds) by another route:

    Gumbel-max:  argmax_i (logits_i / T + g_i),  g_i = -log(-log(u_i)),  u_i ~ U(0, 1)
                 picks token i with probability softmax(logits / T)_i, exactly.

    counter-based randomness:  u_i = hash(seed, position, i)      (no generator state at all)
        row r, position p:  key = mix64(seed_r ^ mix64(p))    (64 bits, once per row)
        token i:            u_i = to_unit(mix32(low32(key) + i * G32))   (32 bits, per token)

So a seeded request's draw depends on its seed, the position of the token it samples and
nothing else: the same tokens whatever else is in its batch and however the batch is split.
Greedy rows (temperature 0, or top_k 1) take the argmax, the same token as `Sampler`. Seeded
sampling is a new random stream: a seed gives other tokens here than under `Sampler`, drawn from
the same distribution (tests/test_device_sampler.py checks it by chi-square). Unseeded rows use a
seed drawn when the request takes its row. It does no penalties; logprobs, when a row asks, are
computed beside it on the device (logprobs.py) and travel to the host with the tokens.

The per-token hash is 32-bit (lowbias32, Chris Wellons' finalizer) because it runs V times per
row: on a CPU, torch's 32-bit lanes do it in half the time of 64-bit ones, and on a GPU
kernels/gumbel.py computes the same bits in one pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoserve.sampling import SamplingParams

# SplitMix64's constants, as signed 64-bit integers (torch has no uint64 arithmetic): a multiply
# or add that overflows wraps around, exactly as the unsigned arithmetic it stands for.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bits (torch's >> copies the sign bit, unsigned >> does not)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors: every input bit flips about half the output bits."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B,) int64: one key per row from its seed and the position it samples."""
    return mix64(seeds ^ mix64(positions))


_GOLDEN_32 = 0x9E3779B9 - 2**32  # the 32-bit golden ratio and lowbias32's multipliers, signed
_LOWBIAS_1 = 0x7FEB352D
_LOWBIAS_2 = 0x846CA68B - 2**32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors, in place: a bijection of 32 bits that spreads every input bit
    (torch's int32 arithmetic wraps like the unsigned one it stands for; shifts are masked). One
    scratch tensor serves every shift: on a CPU, allocating a temporary per operation costs as
    much as the arithmetic."""
    scratch = torch.empty_like(x)
    for shift, mask, multiplier in ((16, 0xFFFF, _LOWBIAS_1), (15, 0x1FFFF, _LOWBIAS_2)):
        torch.bitwise_right_shift(x, shift, out=scratch)
        x.bitwise_xor_(scratch.bitwise_and_(mask))
        x.mul_(multiplier)
    torch.bitwise_right_shift(x, 16, out=scratch)
    return x.bitwise_xor_(scratch.bitwise_and_(0xFFFF))


def uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, V) float32 in (0, 1): u[r, i] = to_unit(mix32(low32(keys[r]) + i * G32)).

    23 random bits each (the top 23 of the hash), centred in their bin: (n + 0.5) / 2**23 is
    exact in float32 (24 significant bits), so u is never 0 or 1 and both logs of the Gumbel
    noise stay finite (with 24 bits the top bin would round to 1.0: noise +inf). The noise then
    spans about [-2.8, 16.6]. Within a row the inputs differ for every token, and mix32 is a
    bijection, so no two tokens of a row share their bits.
    """
    low = ((keys & 0xFFFFFFFF) - ((keys & 0x80000000) << 1)).to(torch.int32)  # low 32, signed
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int32) * _GOLDEN_32
    bits = mix32(low[:, None] + tokens[None, :])
    bits.bitwise_right_shift_(9).bitwise_and_(0x7FFFFF)  # the top 23 bits
    return bits.float().add_(0.5).mul_(1.0 / 2**23)


class SamplingTensors(NamedTuple):
    """One step's sampling parameters, one row per sequence, on the sampler's device.

    temperature 0 is greedy; top_k 0 means no top-k; top_p 1 means no top-p.
    """

    temperature: torch.Tensor  # (B,) float32
    top_k: torch.Tensor  # (B,) int64
    top_p: torch.Tensor  # (B,) float32
    seeds: torch.Tensor  # (B,) int64: the request's seed, or the step's seed when it has none
    positions: torch.Tensor  # (B,) int64: the position of the token each row samples
    filters: bool  # any row uses top-k or top-p (known on the host: no sync to find out)

    @classmethod
    def of(cls, params: list[SamplingParams], positions: list[int], step_seed: int,
           device) -> SamplingTensors:  # fmt: skip
        """From host values, once per batch (stage 11 keeps them in per-row device tensors)."""
        greedy = [p.is_greedy for p in params]
        seeds = [_signed(p.seed if p.seed is not None else step_seed) for p in params]
        return cls(
            temperature=torch.tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy)], device=device
            ),
            top_k=torch.tensor([p.top_k or 0 for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            filters=any(p.top_k is not None or p.top_p < 1.0 for p in params),
        )


def _signed(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 with the same bits."""
    return seed - 2**64 if seed >= 2**63 else seed


def filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(B, V) True where a token survives top-k, then top-p on what top-k kept (as `filter_probs`).

    Top-k keeps every token at least as likely as the k-th; top-p keeps the most likely tokens
    until the mass before the next one reaches p (the token that crosses p stays).
    """
    probs, order = torch.softmax(scaled.float(), dim=-1).sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # 0: every token
    kth = probs.gather(1, (k - 1)[:, None])  # (B, 1) the k-th largest probability
    probs = torch.where(probs >= kth, probs, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted = (probs > 0) & (mass_before < top_p[:, None] * probs.sum(-1, keepdim=True))
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """(B,) int64: per row, argmax(logits / T + Gumbel noise keyed by keys); argmax when T = 0.

    The torch expression of the draw; on a GPU kernels/gumbel.py computes the same in one pass.
    """
    greedy = temperature == 0
    divisor = torch.where(greedy, 1.0, temperature)[:, None]
    scores = uniforms(keys, logits.shape[-1]).log_().neg_().log_().neg_()  # -log(-log(u))
    drawn = scores.add_(logits.float() / divisor).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)  # greedy: in the logits' own dtype


def sample(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Next token ids (B,) int64 on logits' device; the host reads them when it needs them."""
    temperature, keys = tensors.temperature, row_keys(tensors.seeds, tensors.positions)
    if tensors.filters:  # cut each row's distribution first, then draw from what is left
        greedy = temperature == 0
        scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
        logits = scaled.masked_fill(~filter_mask(scaled, tensors.top_k, tensors.top_p), -torch.inf)
        temperature = torch.where(greedy, 0.0, 1.0)  # already divided
    if logits.is_cuda and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from nanoserve.kernels.gumbel import gumbel_argmax as fused

        return fused(logits, temperature, keys)
    return gumbel_argmax(logits, temperature, keys)
