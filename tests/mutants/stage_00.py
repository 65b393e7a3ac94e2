"""Stage 00 mutants: the model's pieces (rms_norm, RoPE, causal grouped attention, SwiGLU) and
top-k / top-p filtering, one realistic learner bug each. No mutant targets the sampler
(`sample`, task 6): the reference is the engine's batched `Sampler` (`sampling.sample_one`), not a
function a learner's bug could be written into; task 6's graded tests and tests/test_sampling.py
check it."""

from __future__ import annotations

from tests.mutants import maker

MASK = "torch.arange(num_k, device=q.device)[None, :] > q_pos"

mutant = maker(0)


MUTANTS = (
    # ---- RMSNorm ----
    mutant(
        "rms_eps_outside_the_root",
        "x / (sqrt(mean(x^2)) + eps) instead of x / sqrt(mean(x^2) + eps)",
        "rms_norm",
        ("x_wide * torch.rsqrt(variance + eps)", "x_wide / (torch.sqrt(variance) + eps)"),
    ),
    mutant(
        "rms_mean_over_the_wrong_dimension",
        "the mean of squares is taken over the tokens (dim 0), not over each row",
        "rms_norm",
        ("x_wide.pow(2).mean(-1, keepdim=True)", "x_wide.pow(2).mean(0, keepdim=True)"),
    ),
    # ---- RoPE ----
    mutant(
        "rotate_half_on_interleaved_pairs",
        "rotate_half pairs dimensions (2i, 2i+1), GPT-J's layout, not the two halves",
        "rotate_half",
        (
            "torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
            "torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)",
        ),
    ),
    mutant(
        "inv_freq_exponent_counts_pairs",
        "the exponents are i / head_dim for i = 0 .. D/2 - 1, not 2i / head_dim",
        "rope_inv_freq",
        (
            "torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim",
            "torch.arange(0, head_dim // 2, dtype=torch.int64).float() / head_dim",
        ),
    ),
    mutant(
        "angles_repeated_interleaved",
        "each angle is repeated in place (a, a, b, b, ...) instead of the halves (a, b, ..., a, b)",
        "rope_cos_sin",
        ("torch.cat((freqs, freqs), dim=-1)", "freqs.repeat_interleave(2, dim=-1)"),
    ),
    mutant(
        "rotation_backwards",
        "q * cos - rotate_half(q) * sin: every position is rotated by minus its angle",
        "apply_rotary",
        (
            "(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)",
            "(q * cos - rotate_half(q) * sin, k * cos - rotate_half(k) * sin)",
        ),
    ),
    # ---- attention ----
    mutant(
        "causal_mask_one_key_late",
        "each query also sees the key right after its own position",
        "attend",
        (MASK, MASK.replace("> q_pos", "> q_pos + 1")),
    ),
    mutant(
        "causal_mask_assumes_tq_equals_tk",
        "query i is taken to sit at position i: with a cached prefix (Tq < Tk) it misses most keys",
        "attend",
        (
            "torch.arange(num_k - num_q, num_k, device=q.device)",
            "torch.arange(num_q, device=q.device)",
        ),
    ),
    mutant(
        "scores_not_scaled",
        "softmax(q k^T) without the 1/sqrt(D) scale",
        "grouped_attention",
        ("torch.matmul(q, k.transpose(-1, -2)) * scale", "torch.matmul(q, k.transpose(-1, -2))"),
    ),
    # ---- SwiGLU ----
    mutant(
        "gate_and_up_swapped",
        "silu is applied to the up projection and multiplies the gate's",
        "swiglu",
        (
            "F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)",
            "F.silu(F.linear(x, up_w)) * F.linear(x, gate_w)",
        ),
    ),
    # ---- top-k, top-p ----
    mutant(
        "top_k_drops_ties",
        "top-k keeps the k indices torch.topk returns: a token tied with the k-th is dropped",
        "filter_probs",
        (
            "torch.where(probs >= kth, probs, 0.0)",
            "torch.zeros_like(probs).index_fill(0, torch.topk(probs, top_k).indices, 1.0) * probs",
        ),
    ),
    mutant(
        "top_p_drops_the_crossing_token",
        "top-p keeps the tokens whose running mass stays below p: the one that crosses p is cut",
        "filter_probs",
        (
            "mass_before < top_p * sorted_probs.sum()",
            "torch.cumsum(sorted_probs, dim=-1) < top_p * sorted_probs.sum()",
        ),
    ),
)
