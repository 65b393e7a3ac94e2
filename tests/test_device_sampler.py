"""The device sampler (stage 11's): greedy equals the host sampler, seeded draws depend on the
request alone, and the draws follow softmax(logits / T) after top-k and top-p (chi-square)."""

import pytest
import torch

from nanoserve.samplers.device_sampler import (
    SamplingTensors,
    filter_mask,
    gumbel_argmax,
    mix64,
    row_keys,
    sample,
    uniforms,
)
from nanoserve.sampling import Sampler, SamplingParams, filter_probs

V = 8
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])


def draws(params: SamplingParams, positions: range, logits=LOGITS) -> torch.Tensor:
    """One draw per position from the same logits: a seeded request's stream over a sequence."""
    n = len(positions)
    tensors = SamplingTensors.of([params] * n, list(positions), step_seed=0, device="cpu")
    return sample(logits.expand(n, -1), tensors)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= the statistic) for counts against probs, over the tokens probs allows."""
    allowed = probs > 0
    assert counts[~allowed].sum() == 0, "a token outside top-k / top-p was drawn"
    expected = probs[allowed] / probs.sum() * counts.sum()
    statistic = ((counts[allowed] - expected) ** 2 / expected).sum()
    dof = int(allowed.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2))


def test_greedy_rows_take_the_host_samplers_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=1)] * 2 + [SamplingParams()]
    want = Sampler()(logits, params, [None] * 5)
    got = sample(logits, SamplingTensors.of(params, [3] * 5, step_seed=9, device="cpu"))
    assert got.tolist() == want


def test_a_seeded_row_draws_the_same_token_whatever_its_batch_mates():
    params = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=0.5, top_p=0.9)
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    alone = sample(logits[1:2], SamplingTensors.of([params], [17], 5, "cpu"))
    batched = sample(logits, SamplingTensors.of([other, params, other], [4, 17, 9], 6, "cpu"))
    assert batched[1] == alone[0]


def test_a_seed_gives_a_different_stream_at_each_position_and_for_each_seed():
    a = draws(SamplingParams(temperature=1.0, seed=1), range(64))
    b = draws(SamplingParams(temperature=1.0, seed=2), range(64))
    assert len(set(a.tolist())) > 3, "one seed must not repeat one token at every position"
    assert a.tolist() != b.tolist()
    assert a.tolist() == draws(SamplingParams(temperature=1.0, seed=1), range(64)).tolist()


def test_seeds_above_two_to_the_63_are_accepted_and_distinct():
    a = draws(SamplingParams(temperature=1.0, seed=2**64 - 1), range(32))
    b = draws(SamplingParams(temperature=1.0, seed=2**63 - 1), range(32))
    assert a.tolist() != b.tolist()


def test_the_uniforms_are_uniform_and_the_mixer_spreads_neighbouring_inputs():
    u = uniforms(row_keys(torch.tensor([7]), torch.tensor([0])), 200_000)[0]
    assert u.min() > 0 and u.max() < 1
    top_bin = torch.tensor([(2**23 - 1 + 0.5) / 2**23], dtype=torch.float32)
    assert top_bin < 1 and torch.isfinite(-torch.log(-torch.log(top_bin))).all()
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert chi_square_p_value(counts, torch.ones(20)) > 1e-4
    bits = mix64(torch.arange(1000)) ^ mix64(torch.arange(1, 1001))
    flipped = sum(bin(int(x) & (2**64 - 1)).count("1") for x in bits) / 1000
    assert 28 < flipped < 36, f"neighbouring inputs differ in {flipped} of 64 bits on average"


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, 1.0), (0.6, None, 1.0), (1.3, 4, 1.0), (1.0, None, 0.8), (0.8, 5, 0.7)],
)
def test_draws_follow_the_filtered_softmax(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=42)
    tokens = draws(params, range(20_000))
    counts = torch.bincount(tokens, minlength=V).double()
    want = filter_probs(torch.softmax(LOGITS.double() / temperature, dim=-1), top_k, top_p)
    assert chi_square_p_value(counts, want) > 1e-4, (counts.tolist(), want.tolist())


def test_a_biased_sampler_fails_the_chi_square_check():
    params = SamplingParams(temperature=1.0, seed=42)
    tokens = draws(params, range(20_000), logits=LOGITS + torch.tensor([0.1] + [0.0] * (V - 1)))
    counts = torch.bincount(tokens, minlength=V).double()
    want = torch.softmax(LOGITS.double(), dim=-1)  # the check must see a 10 % shift on token 0
    assert chi_square_p_value(counts, want) < 1e-4


def test_the_filter_matches_the_host_filter_row_by_row():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    top_k = torch.tensor([0, 1, 5, 0, 7, 30])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.9, 0.3])
    mask = filter_mask(logits, top_k, top_p)
    for r in range(6):
        k = int(top_k[r]) or None
        want = filter_probs(torch.softmax(logits[r], dim=-1), k, float(top_p[r])) > 0
        assert mask[r].tolist() == want.tolist(), r


def test_the_triton_kernel_draws_the_torch_expressions_tokens():
    """kernels/gumbel.py (one pass, on a GPU) against the torch expression of the same draw:
    random, greedy and near-zero temperatures, a vocabulary of several tiles and a ragged one."""
    pytest.importorskip("triton")
    from nanoserve.kernels.gumbel import gumbel_argmax as fused

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU
    gen = torch.Generator().manual_seed(3)
    # smaller tiles split each row into spans of two tiles: 300 logits in tiles of 16 make 10
    # spans of 32, the last of 12; 5,000 in tiles of 256 make 10 spans of 512, the last of 392
    # (one whole tile and a ragged one). The interpreter runs one program per row and span.
    for vocab_size, block in ((300, 16), (5000, 256)):
        logits = (torch.randn(16, vocab_size, generator=gen) * 3).to(device)
        temperature = torch.tensor([0.0, 1.0, 0.6, 1e-3] * 4, device=device)
        seeds = torch.randint(-(2**62), 2**62, (16,), generator=gen).to(device)
        keys = row_keys(seeds, torch.arange(16, device=device) * 7)
        want = gumbel_argmax(logits, temperature, keys)
        assert fused(logits, temperature, keys).tolist() == want.tolist()  # one span a row
        assert fused(logits, temperature, keys, block=block).tolist() == want.tolist()


def test_split_rows_break_ties_to_the_first_index_and_survive_rows_of_minus_infinity():
    """The kernels split a row into spans: equal maxima in different spans give the first
    index (as argmax does), and a row with nothing left to draw gives 0 (as one pass did)."""
    pytest.importorskip("triton")
    from nanoserve.kernels.gumbel import gumbel_argmax as fused

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.zeros(3, 200, device=device)
    logits[0, [70, 130, 199]] = 5.0  # three spans of 32 hold the maximum; argmax says 70
    logits[1] = -torch.inf
    logits[2, 33] = logits[2, 31] = 1.0  # a tie across a span boundary (32)
    greedy = torch.zeros(3, device=device)
    keys = torch.arange(3, device=device)
    assert fused(logits, greedy, keys, block=16).tolist() == [70, 0, 31]
