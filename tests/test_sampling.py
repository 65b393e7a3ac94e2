"""The sampler: greedy, top-k, top-p, seeds, and the sampled distribution itself."""

import pytest
import torch

from nanoserve.sampling import Sampler, SamplingParams, filter_probs, make_generator

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])


def sample(logits, params, seed=None):
    gens = [make_generator(params, logits.device) for _ in range(len(logits))]
    if seed is not None:
        torch.manual_seed(seed)
    return Sampler()(logits, [params] * len(logits), gens)


def test_temperature_zero_is_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0)) == LOGITS.argmax(-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    for seed in range(5):
        assert sample(LOGITS, SamplingParams(temperature=5.0, top_k=1), seed) == [4, 5]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    kept = filter_probs(probs, top_k=None, top_p=0.7)  # 0.4 + 0.3 = 0.7 reaches p
    assert (kept > 0).tolist() == [False, True, False, True, False]
    kept = filter_probs(probs, top_k=None, top_p=0.71)  # needs the third, 0.15
    assert (kept > 0).tolist() == [False, True, False, True, True]


def test_top_k_keeps_the_k_most_likely():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    assert (filter_probs(probs, top_k=2, top_p=1.0) > 0).tolist() == [
        False,
        True,
        False,
        True,
        False,
    ]


def test_same_seed_gives_same_tokens_whatever_the_global_rng():
    params = SamplingParams(temperature=1.0, seed=1234)
    big = torch.randn(2, 1000)
    a = [sample(big, params, seed=s) for s in range(3)]  # fresh generator per call, global varies
    assert a[0] == a[1] == a[2]


def test_different_seeds_give_different_draws_somewhere():
    big = torch.zeros(1, 1000)  # uniform: 1000 equally likely tokens
    draws = {tuple(sample(big, SamplingParams(temperature=1.0, seed=s))) for s in range(10)}
    assert len(draws) > 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_match_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    num_draws = 20_000
    params = SamplingParams(temperature=temperature)
    torch.manual_seed(7)
    tokens = Sampler()(logits.expand(num_draws, -1), [params] * num_draws, [None] * num_draws)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
    expected = torch.softmax(logits.double() / temperature, -1) * num_draws
    # each bin is binomial: allow 5 standard deviations
    sigma = (expected * (1 - expected / num_draws)).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma).all(), (counts, expected)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_k", 0), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0)],
)
def test_invalid_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})
