"""Stage 00's graded contract: the decoder's arithmetic and the sampler, checked against oracles.

Run against any implementation with `pytest stages/00_model --impl ref|starter|path/to/yours.py`.
Each oracle is written here from first principles (float64, loops where loops are clearer) or is
Hugging Face transformers' own Llama code; no test looks at how an implementation stores anything.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from nanoserve.testing import tiny_hf_model


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)  # the same random inputs on every run, so a grade never flickers


# ---- oracles and helpers ----


def rms_norm_oracle(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def attention_oracle(q, k, v, scale):
    """One query, one head at a time: softmax over the keys at or before the query's position."""
    num_q, num_heads, _ = q.shape
    num_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for h in range(num_heads):
        k_h, v_h = k[:, h // group], v[:, h // group]
        for i in range(num_q):
            visible = num_k - num_q + i + 1  # keys 0 ..= the query's own position
            weights = torch.softmax(k_h[:visible] @ q[i, h] * scale, dim=0)
            out[i, h] = weights @ v_h[:visible]
    return out


def chi_square_survival(x, dof):
    """P(X >= x), X ~ chi-square(dof): Q(k + 2) = Q(k) + (x/2)^(k/2) e^(-x/2) / Gamma(k/2 + 1)."""
    q, k = (math.erfc(math.sqrt(x / 2)), 1) if dof % 2 else (math.exp(-x / 2), 2)
    while k < dof:
        q += math.exp((k / 2) * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1)) if x else 0.0
        k += 2
    return q


def draw_counts(impl, logits, num_draws, seed, temperature=1.0, top_k=None, top_p=1.0):
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for _ in range(num_draws):
        counts[int(impl.sample(logits, temperature, top_k, top_p, generator))] += 1
    return counts


def assert_frequencies_match(counts, expected_probs):
    """Chi-square goodness of fit over the tokens that may be drawn; p < 1e-6 means wrong."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"drew excluded tokens {counts.nonzero().flatten()}"
    expected = expected_probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    p_value = chi_square_survival(stat, int(support.sum()) - 1)
    assert p_value > 1e-6, f"draw counts {counts.tolist()} vs expected {expected.tolist()}"


def support_of(probs):
    return set(torch.nonzero(probs).flatten().tolist())


@pytest.fixture(scope="module")
def tiny_llama():
    """A random Hugging Face Llama (hidden 64, 2 layers, 4 heads, 2 kv heads) in float64."""
    return tiny_hf_model("llama")


# ---- task 1: RMSNorm ----


def test_task_1_rms_norm_matches_the_formula_in_float64(impl):
    x, weight = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    torch.testing.assert_close(impl.rms_norm(x, weight, 1e-6), rms_norm_oracle(x, weight, 1e-6))


def test_task_1_rms_norm_gives_unit_root_mean_square_with_unit_weight(impl):
    x = 10 * torch.randn(4, 32, dtype=torch.float64)
    y = impl.rms_norm(x, torch.ones(32, dtype=torch.float64), 1e-12)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4, dtype=torch.float64))


def test_task_1_rms_norm_of_zeros_is_zeros_not_nan(impl):
    x = torch.zeros(2, 8)
    torch.testing.assert_close(impl.rms_norm(x, torch.ones(8), 1e-6), x)


def test_task_1_rms_norm_keeps_shape_and_bfloat16_and_matches_hugging_face(impl):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = impl.rms_norm(x, hf.weight.detach(), 1e-5)
    got = (tuple(y.shape), y.dtype)
    want = (tuple(x.shape), torch.bfloat16)
    assert got == want, f"rms_norm returned (shape, dtype) {got}, expected the input's {want}"
    torch.testing.assert_close(y, hf(x).detach())


# ---- task 2: RoPE ----


def test_task_2_rotate_half_maps_halves_to_minus_second_then_first(impl):
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    expected = torch.tensor([[-3.0, -4.0, 1.0, 2.0], [-7.0, -8.0, 5.0, 6.0]])
    torch.testing.assert_close(impl.rotate_half(x), expected)


def test_task_2_inv_freq_is_theta_to_the_minus_two_i_over_head_dim(impl):
    inv_freq = impl.rope_inv_freq(4, 10000.0)
    got = (tuple(inv_freq.shape), inv_freq.dtype)
    want = ((2,), torch.float32)
    assert got == want, f"rope_inv_freq(4, ...) gave (shape, dtype) {got}, expected {want}"
    torch.testing.assert_close(inv_freq, torch.tensor([1.0, 0.01]))
    expected = torch.tensor([500000.0 ** (-2 * i / 64) for i in range(32)])
    torch.testing.assert_close(impl.rope_inv_freq(64, 500000.0), expected)


def test_task_2_cos_sin_hold_position_times_frequency_in_both_halves(impl):
    # the lesson's worked trace: position 2, head_dim 4, theta 10000 -> angles [2, 0.02, 2, 0.02]
    inv_freq = impl.rope_inv_freq(4, 10000.0)
    cos, sin = impl.rope_cos_sin(torch.tensor([0, 2]), inv_freq, torch.float64)
    got = [(tuple(t.shape), t.dtype) for t in (cos, sin)]
    want = [((2, 4), torch.float64)] * 2
    assert got == want, f"(shape, dtype) of cos and sin: {got}, expected {want}"
    angles = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.02, 2.0, 0.02]], dtype=torch.float64)
    torch.testing.assert_close(cos, angles.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, angles.sin(), atol=1e-6, rtol=0)


def rotate(impl, q, k, positions, theta=10000.0):
    cos, sin = impl.rope_cos_sin(positions, impl.rope_inv_freq(q.shape[-1], theta), q.dtype)
    return impl.apply_rotary(q, k, cos, sin)


def test_task_2_rotation_at_position_zero_is_the_identity(impl):
    q, k = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(1, 2, 8, dtype=torch.float64)
    q_rot, k_rot = rotate(impl, q, k, torch.tensor([0]))
    torch.testing.assert_close(q_rot, q)
    torch.testing.assert_close(k_rot, k)


def test_task_2_rotation_preserves_every_head_vector_norm(impl):
    q, k = torch.randn(6, 4, 8, dtype=torch.float64), torch.randn(6, 2, 8, dtype=torch.float64)
    q_rot, k_rot = rotate(impl, q, k, torch.arange(100, 106))
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(k_rot.norm(dim=-1), k.norm(dim=-1), rtol=1e-6, atol=0)
    assert not torch.allclose(q_rot, q), "positions 100..105 must actually rotate q"


def test_task_2_rotated_scores_depend_only_on_the_distance_between_positions(impl):
    q, k = torch.randn(1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 8, dtype=torch.float64)
    scores = []
    for q_pos, k_pos in [(7, 3), (12, 8), (40, 36)]:  # the query is always 4 tokens after the key
        q_rot, _ = rotate(impl, q, k, torch.tensor([q_pos]))
        _, k_rot = rotate(impl, q, k, torch.tensor([k_pos]))
        scores.append(float((q_rot * k_rot).sum()))
    assert scores == pytest.approx([scores[0]] * 3, abs=1e-5), (
        f"q.k at positions (7, 3), (12, 8), (40, 36) gave {scores}: all are 4 apart, so all "
        "three scores must be equal"
    )


def test_task_2_rope_matches_hugging_face_llama_rotary_embedding(impl):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    positions = torch.tensor([0, 1, 2, 9, 31, 0, 1])  # two packed sequences
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions[None, :])
    theta = config.rope_parameters["rope_theta"]
    cos, sin = impl.rope_cos_sin(positions, impl.rope_inv_freq(16, theta), torch.float32)
    torch.testing.assert_close(cos, hf_cos[0])
    torch.testing.assert_close(sin, hf_sin[0])
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos[0], hf_sin[0], unsqueeze_dim=1)
    q_rot, k_rot = impl.apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(q_rot, hf_q)
    torch.testing.assert_close(k_rot, hf_k)


# ---- task 3: attention ----


@pytest.mark.parametrize(
    ("num_q", "num_k"), [(5, 5), (1, 5), (2, 6)], ids=["prefill", "one-query", "two-queries"]
)
def test_task_3_attention_matches_a_per_query_softmax_oracle(impl, num_q, num_k):
    q = torch.randn(num_q, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, num_k, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(impl.attend(q, k, v, 0.3), attention_oracle(q, k, v, 0.3))


def test_task_3_scores_in_the_hundreds_stay_finite_in_float32(impl):
    # whole numbers keep the products exact; scores reach several hundred, and exp(89) is
    # already past float32's range: a softmax must subtract each row's max before exp
    q, k = (
        (torch.randn(n, h, 8, generator=torch.Generator().manual_seed(n)) * 15).round()
        for n, h in ((4, 4), (6, 2))
    )
    v = torch.randn(6, 2, 8)
    out = impl.attend(q, k, v, 1.0)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1))
    assert torch.isfinite(out).all(), (
        f"attend returned NaN or inf for scores as large as {scores.abs().max():.0f}: "
        "exp of scores whose row max was not subtracted overflows float32"
    )
    want = attention_oracle(q.double(), k.double(), v.double(), 1.0)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


def test_task_3_changing_a_future_token_leaves_earlier_outputs_unchanged(impl):
    q = torch.randn(6, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 6, 2, 8, dtype=torch.float64)
    before = impl.attend(q, k, v, 8**-0.5)
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = torch.randn(2, 2, 2, 8, dtype=torch.float64)  # rewrite tokens 4 and 5
    after = impl.attend(q, k2, v2, 8**-0.5)
    torch.testing.assert_close(
        after[:4],
        before[:4],
        msg=lambda m: (
            "rewriting the keys and values of tokens 4 and 5 changed the outputs of "
            f"tokens 0-3: a query sees a key in its future (mask keys past Tk - Tq + i)\n{m}"
        ),
    )
    assert not torch.allclose(after[4:], before[4:]), "token 4 must see its own new key"


def test_task_3_grouped_query_attention_equals_repeating_each_kv_head(impl):
    q = torch.randn(5, 6, 8, dtype=torch.float64)  # 6 query heads share 2 kv heads, 3 each
    k, v = torch.randn(2, 5, 2, 8, dtype=torch.float64)
    repeated = [t.repeat_interleave(3, dim=1) for t in (k, v)]  # kv head g -> query heads 3g..3g+2
    torch.testing.assert_close(impl.attend(q, k, v, 0.5), impl.attend(q, *repeated, 0.5))


def test_task_3_a_lone_token_returns_its_own_value(impl):
    q = torch.randn(1, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, 8, dtype=torch.float64)
    expected = v.repeat_interleave(2, dim=1)  # query heads 0, 1 read kv head 0; 2, 3 read 1
    torch.testing.assert_close(impl.attend(q, k, v, 1.0), expected)


def test_task_3_output_has_the_query_shape_and_dtype(impl):
    q = torch.randn(3, 4, 8, dtype=torch.bfloat16)
    k, v = torch.randn(2, 7, 1, 8, dtype=torch.bfloat16)
    out = impl.attend(q, k, v, 8**-0.5)
    got = (tuple(out.shape), out.dtype)
    want = ((3, 4, 8), torch.bfloat16)
    assert got == want, f"attend returned (shape, dtype) {got}, expected the query's {want}"
    expected = attention_oracle(q.double(), k.double(), v.double(), 8**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


# ---- task 4: the MLP ----


def test_task_4_swiglu_is_down_of_silu_gate_times_up(impl):
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    gate_w, up_w = torch.randn(2, 16, 8, dtype=torch.float64)
    down_w = torch.randn(8, 16, dtype=torch.float64)
    gate, up = x @ gate_w.T, x @ up_w.T
    expected = (gate * torch.sigmoid(gate) * up) @ down_w.T
    torch.testing.assert_close(impl.swiglu(x, gate_w, up_w, down_w), expected)


def test_task_4_swiglu_matches_hugging_face_llama_mlp(impl):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64)).to(torch.float64)
    x = torch.randn(5, 32, dtype=torch.float64)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    torch.testing.assert_close(impl.swiglu(x, *weights), mlp(x).detach())


# ---- task 5: top-k and top-p ----

# dyadic probabilities add up exactly in float32, so "reaches p" has no rounding doubt
DYADIC = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625])


def test_task_5_top_k_keeps_exactly_the_k_most_likely_tokens(impl):
    probs = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1 - 1e-3, 1e-3])
    for top_k, want in [(3, {1, 3, 4}), (1, {1})]:
        got = support_of(impl.filter_probs(probs, top_k, 1.0))
        assert got == want, f"top_k={top_k} kept tokens {sorted(got)}, expected {sorted(want)}"


def test_task_5_a_token_tied_with_the_kth_is_kept(impl):
    got = support_of(impl.filter_probs(torch.tensor([0.4, 0.2, 0.2, 0.2]), 2, 1.0))
    assert got == {0, 1, 2, 3}, (
        f"top_k=2 on [0.4, 0.2, 0.2, 0.2] kept tokens {sorted(got)}, expected all four: tokens "
        "2 and 3 are as likely as the 2nd (keep every token at least as likely as the k-th, "
        "not the k indices torch.topk happens to return)"
    )


TOP_P_CASES = [(0.4, {1}), (0.5, {1}), (0.7, {1, 3}), (0.75, {1, 3}), (0.8, {0, 1, 3})]


@pytest.mark.parametrize(
    ("top_p", "kept"), [pytest.param(p, kept, id=f"p={p}") for p, kept in TOP_P_CASES]
)
def test_task_5_top_p_keeps_the_smallest_set_whose_mass_reaches_p(impl, top_p, kept):
    got = support_of(impl.filter_probs(DYADIC, None, top_p))
    assert got == kept, (
        f"top_p={top_p} over probs {DYADIC.tolist()} kept tokens {sorted(got)}, expected "
        f"{sorted(kept)}"
    )


def test_task_5_top_p_is_measured_on_what_top_k_left(impl):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # after top-2 the mass is 0.7, so token 0 alone holds 0.4 / 0.7 > 0.5 of it
    got = support_of(impl.filter_probs(probs, 2, 0.5))
    assert got == {0}, f"top_k=2 then top_p=0.5 kept tokens {sorted(got)}, expected [0]"


def test_task_5_kept_tokens_keep_their_relative_sizes_and_input_is_untouched(impl):
    probs = torch.softmax(torch.randn(50, dtype=torch.float64), dim=0)
    original = probs.clone()
    filtered = impl.filter_probs(probs, 10, 0.6)
    torch.testing.assert_close(probs, original)
    kept = filtered > 0
    num_kept = int(kept.sum())
    assert 1 <= num_kept <= 10, f"top_k=10 kept {num_kept} tokens, expected 1 to 10"
    ratio = filtered[kept] / probs[kept]
    torch.testing.assert_close(ratio, ratio[0].expand_as(ratio))


def test_task_5_no_limits_keep_every_token(impl):
    probs = torch.softmax(torch.randn(20), dim=0)
    for top_k in (None, 20):
        got = support_of(impl.filter_probs(probs, top_k, 1.0))
        dropped = sorted(set(range(20)) - got)
        assert got == set(range(20)), f"top_k={top_k}, top_p=1.0 dropped tokens {dropped}"


# ---- task 6: sampling ----


def test_task_6_temperature_zero_returns_the_argmax(impl):
    for seed in range(5):
        logits = torch.randn(100, generator=torch.Generator().manual_seed(seed))
        got, want = int(impl.sample(logits, 0.0, None, 1.0, None)), int(logits.argmax())
        assert got == want, f"temperature 0 (logits seed {seed}) sampled {got}, argmax is {want}"


def test_task_6_top_k_one_returns_the_argmax_at_any_temperature(impl):
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    generator = torch.Generator().manual_seed(0)
    tokens = {int(impl.sample(logits, 5.0, 1, 1.0, generator)) for _ in range(50)}
    assert tokens == {1}, f"top_k=1 at temperature 5 drew tokens {sorted(tokens)}, expected [1]"


def test_task_6_the_same_seed_gives_the_same_tokens_whatever_ran_between(impl):
    logits = torch.zeros(10)
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)  # the global stream differs; the private one does not
        generator = torch.Generator().manual_seed(1234)
        runs.append([int(impl.sample(logits, 1.0, None, 1.0, generator)) for _ in range(40)])
    assert runs[0] == runs[1], (
        f"seed 1234 drew {runs[0]} after torch.manual_seed(1) but {runs[1]} after "
        "torch.manual_seed(2): draw from the generator passed in, not the global stream"
    )
    assert len(set(runs[0])) > 1, "a flat distribution must not always give the same token"


def test_task_6_draws_follow_softmax_of_logits_over_temperature(impl):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    counts = draw_counts(impl, logits, 3000, seed=7, temperature=0.7)
    assert_frequencies_match(counts, torch.softmax(logits.double() / 0.7, dim=0))


def test_task_6_draws_follow_the_renormalized_top_k_top_p_distribution(impl):
    logits = torch.tensor([1.0, 3.0, 0.0, 2.0, 2.5, -2.0])
    probs = torch.softmax(logits.double(), dim=0)
    # top_k 4 keeps tokens 1, 4, 3, 0; their renormalized masses (in that order) cross 0.75 at 4
    expected = torch.zeros(6, dtype=torch.float64)
    expected[[1, 4]] = probs[[1, 4]] / probs[[1, 4]].sum()
    counts = draw_counts(impl, logits, 2000, seed=3, top_k=4, top_p=0.75)
    assert_frequencies_match(counts, expected)


# ---- task 7: a whole forward pass, assembled from your pieces ----


def forward_with(impl, hf_model, input_ids, positions, cu_seqlens):
    """Logits (T, vocab) for packed sequences, from impl's pieces and the HF model's weights."""
    config, layers = hf_model.config, hf_model.model.layers
    num_tokens, head_dim, eps = len(input_ids), config.head_dim, config.rms_norm_eps
    x = hf_model.model.embed_tokens.weight[input_ids]  # (T, hidden)
    inv_freq = impl.rope_inv_freq(head_dim, config.rope_parameters["rope_theta"])
    cos, sin = impl.rope_cos_sin(positions, inv_freq, x.dtype)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = impl.rms_norm(x, layer.input_layernorm.weight, eps)
        q = F.linear(h, attn.q_proj.weight).view(num_tokens, -1, head_dim)
        k = F.linear(h, attn.k_proj.weight).view(num_tokens, -1, head_dim)
        v = F.linear(h, attn.v_proj.weight).view(num_tokens, -1, head_dim)
        q, k = impl.apply_rotary(q, k, cos, sin)
        bounds = itertools.pairwise(cu_seqlens)  # each sequence attends only to itself
        out = torch.cat([impl.attend(q[s:e], k[s:e], v[s:e], head_dim**-0.5) for s, e in bounds])
        x = x + F.linear(out.reshape(num_tokens, -1), attn.o_proj.weight)
        h = impl.rms_norm(x, layer.post_attention_layernorm.weight, eps)
        x = x + impl.swiglu(h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    x = impl.rms_norm(x, hf_model.model.norm.weight, eps)
    return F.linear(x, hf_model.lm_head.weight)


@torch.no_grad()
def test_task_7_assembled_pieces_reproduce_hugging_face_logits_for_packed_prompts(impl, tiny_llama):
    prompts = [[5, 17, 200], [42, 7]]  # packed: cu_seqlens [0, 3, 5], positions [0, 1, 2, 0, 1]
    input_ids = torch.tensor(prompts[0] + prompts[1])
    positions = torch.tensor([0, 1, 2, 0, 1])
    logits = forward_with(impl, tiny_llama, input_ids, positions, [0, 3, 5])
    expected = torch.cat([tiny_llama(torch.tensor([p])).logits[0] for p in prompts])
    # HF's RMSNorm squares in float32 even in a float64 model: agreement is ~1e-7, not 1e-15
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_task_7_greedy_generation_that_recomputes_everything_matches_hugging_face(impl, tiny_llama):
    prompt = [5, 17, 200, 3]
    tokens = list(prompt)
    for _ in range(8):  # no KV cache: every step feeds the whole sequence again
        logits = forward_with(
            impl, tiny_llama, torch.tensor(tokens), torch.arange(len(tokens)), [0, len(tokens)]
        )
        tokens.append(int(impl.sample(logits[-1], 0.0, None, 1.0, None)))
    ids = torch.tensor([prompt])
    hf_tokens = tiny_llama.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
    )
    want = hf_tokens[0].tolist()
    first = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), len(want))
    assert tokens == want, (
        f"generated {tokens}, Hugging Face {want}: they part at position {first} (the prompt "
        f"is positions 0-{len(prompt) - 1})"
    )


# ---- engine-level check ----
# Stage 00 has no swappable engine component: its pieces are plain functions, and task 7 above
# already runs them as a whole model. Later stages plug the learner's class into the engine here.
