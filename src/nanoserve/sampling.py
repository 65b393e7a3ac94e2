"""Sampling parameters and the sampler that turns logits into next tokens.

Introduced in stage 00. Temperature 0 is greedy (argmax); otherwise softmax(logits / T), cut to
top-k and then top-p, and one draw per sequence: a single uniform number mapped through the
cumulative distribution (inverse-CDF sampling), batched over rows. `SamplingParams` also carries
what the sampler does not do itself: stop strings and `n` (done by `LLM`, detokenizer.py) and
`logprobs` (logprobs.py); `clamp` maps what validation accepts but no sampler holds to its
meaning (the engine applies it at admission). It does no beam search and no penalties.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from nanoserve.config import is_int, is_real

# torch.Generator.manual_seed takes [-2**63, 2**64) and maps a negative seed s to s + 2**64, so -1
# would silently be the stream of 2**64 - 1 (and elsewhere -1 often means "unseeded"). We accept
# the generator's own unsigned 64-bit seeds only: [0, 2**64).
SEED_LIMIT = 2**64
MAX_STOP_STRINGS = 16  # the server's defaults too (serving/limits.py): each is searched per token
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # OpenAI's and vLLM's default cap
_NUMBER_TYPES = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_tokens": int,
    "seed": int,
    "n": int,
    "logprobs": int,
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; every field's type and range checked on creation."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # any iterable of ids is accepted and stored as a tuple
    seed: int | None = None
    stop: tuple[str, ...] = ()  # one str or an iterable of them; stored as a tuple
    include_stop_str_in_output: bool = False
    n: int = 1  # completions per prompt: LLM.generate runs n sequences (`child_params`)
    logprobs: int | None = None  # per token: its log-probability and the top-`logprobs` ones

    def __post_init__(self):
        t, k, p, n, seed = self.temperature, self.top_k, self.top_p, self.max_tokens, self.seed
        _check(is_real(t) and t >= 0, "temperature", t, "a finite number >= 0 (0 means greedy)")
        _check(k is None or (is_int(k) and k >= 1), "top_k", k, "None or an int >= 1")
        _check(is_real(p) and 0 < p <= 1, "top_p", p, "a number in (0, 1]")
        _check(is_int(n) and n >= 1, "max_tokens", n, "an int >= 1")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        _check(
            seed is None or (is_int(seed) and 0 <= seed < SEED_LIMIT),
            "seed",
            seed,
            "None or an int in [0, 2**64)",
        )
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        include = self.include_stop_str_in_output
        _check(isinstance(include, bool), "include_stop_str_in_output", include, "a bool")
        _check(is_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        lp = self.logprobs
        expected = f"None or an int in [0, {MAX_LOGPROBS}]"
        _check(lp is None or (is_int(lp) and 0 <= lp <= MAX_LOGPROBS), "logprobs", lp, expected)
        for name, kind in _NUMBER_TYPES.items():
            value = getattr(self, name)
            if value is not None:  # numpy numbers in, Python numbers out (manual_seed needs int)
                object.__setattr__(self, name, kind(value))

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the argmax."""
        return self.temperature == 0 or self.top_k == 1


def _stop_token_ids(value) -> tuple[int, ...]:
    """Any iterable of token ids (ints >= 0) as a tuple of Python ints; a str is no such thing."""
    expected = "an iterable of token ids (ints >= 0)"
    is_iterable = isinstance(value, Iterable) and not isinstance(value, (str, bytes, bytearray))
    _check(is_iterable, "stop_token_ids", value, expected)
    ids = tuple(value)
    _check(all(is_int(i) and i >= 0 for i in ids), "stop_token_ids", ids, expected)
    return tuple(int(i) for i in ids)


def _stop_strings(value) -> tuple[str, ...]:
    """One stop string or an iterable of them, as a tuple; each non-empty, within the limits."""
    expected = (
        f"a str or a list of at most {MAX_STOP_STRINGS} non-empty strs of at most "
        f"{MAX_STOP_CHARS} characters each"
    )
    if isinstance(value, str):
        value = (value,)
    _check(isinstance(value, Iterable) and not isinstance(value, bytes), "stop", value, expected)
    stops = tuple(value)
    ok = len(stops) <= MAX_STOP_STRINGS and all(
        isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops
    )
    _check(ok, "stop", stops, expected)
    return stops


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The n one-completion requests that a request for n completions runs as.

    Child 0 is the request itself (so n=1 and the first of n give the same tokens); child i > 0
    of a seeded request gets its own seed, derived from the request's and i: the children differ
    and a rerun repeats them. Unseeded children draw unseeded; greedy ones are all equal.
    """
    children = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None and i > 0:
            seed = (seed + i * _GOLDEN_64) % SEED_LIMIT
        children.append(replace(params, n=1, seed=seed))
    return children


_GOLDEN_64 = 0x9E3779B97F4A7C15  # an odd constant: seed + i * it never repeats for i < 2**64

# The samplers hold temperature and top-p in float32 and top-k in int64 (stage 11's device rows).
MIN_TEMPERATURE = 1e-5  # below it greedy (vLLM's _SAMPLING_EPS); far below, logits / T overflows
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)  # above it float32 holds inf


def clamp(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """params as every stage's sampler runs them (the engine admits requests with these), so that
    no value validation accepts can fail a step, and with it every request batched with it.

    - top_k >= vocab_size: None (no limit; it keeps every token anyway).
    - temperature below MIN_TEMPERATURE: 0, greedy (the limit of softmax(logits / T) as T -> 0);
      above MAX_TEMPERATURE: MAX_TEMPERATURE (softmax(logits / T) is flat long before).
    - top_p below 1 / (2 vocab_size): raised to it. Any p that small keeps the most likely token
      alone (its mass is at least 1 / vocab_size of the total), but p * total may round to 0 in
      float32, and then no token is kept at all.
    - logprobs above vocab_size: vocab_size (a model has no more tokens to report).

    Seeds need nothing: validation holds them to [0, 2**64), the counter hash's 64 bits.
    """
    top_k, temperature, top_p = params.top_k, params.temperature, params.top_p
    if top_k is not None and top_k >= vocab_size:
        top_k = None
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    temperature = min(temperature, MAX_TEMPERATURE)
    top_p = max(top_p, 0.5 / vocab_size)
    logprobs = params.logprobs if params.logprobs is None else min(params.logprobs, vocab_size)
    return replace(params, top_k=top_k, temperature=temperature, top_p=top_p, logprobs=logprobs)


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} = {value!r} is invalid; expected {allowed}")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private random stream for a seeded request, so its tokens ignore its batch-mates."""
    if params.seed is None or params.is_greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def filter_probs(probs: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Zero every token outside the top-k, then outside the smallest set whose mass reaches p."""
    if top_k is not None and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = mass_before < top_p * sorted_probs.sum()  # the crossing token stays
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    return probs


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token i of each row where u * total falls in [cdf[i-1], cdf[i]): probability p_i.

    probs (B, V), unnormalized is fine; uniforms (B, 1) in [0, 1). `right=True` skips tokens of
    zero probability even when u is exactly 0.
    """
    cdf = probs.cumsum(dim=-1)
    targets = uniforms * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).clamp(max=probs.shape[-1] - 1)[:, 0]


class Sampler:
    """Picks one token per row of a logits batch."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """Next token ids for logits (B, V), one SamplingParams and generator per row."""
        token_ids = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not rows:
            return token_ids.tolist()
        row_index = torch.tensor(rows, device=logits.device)
        temperatures = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        probs = torch.softmax(logits[row_index].float() / temperatures[:, None], dim=-1)
        uniforms = torch.rand(len(rows), 1, device=logits.device)  # one U[0, 1) draw per row
        for j, i in enumerate(rows):
            if params[i].top_k is not None or params[i].top_p < 1.0:
                probs[j] = filter_probs(probs[j], params[i].top_k, params[i].top_p)
            if generators[i] is not None:  # a seeded request draws from its own stream
                uniforms[j] = torch.rand(1, generator=generators[i], device=logits.device)
        token_ids[row_index] = inverse_cdf(probs, uniforms)
        return token_ids.tolist()


def sample_one(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """One token id drawn from logits (V,) by the `Sampler` (stage 00's graded `sample`)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=1)
    return Sampler()(logits[None, :], [params], [generator])[0]
