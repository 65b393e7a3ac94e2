"""Stage 00 starter: the arithmetic of one decoder forward pass, and the sampler, for you to write.

Fill in each body (the lesson, stages/00_model/README.md, walks through them in task order) in a
copy: `cp stages/00_model/starter.py my_model.py`, then grade it with
`pytest stages/00_model --impl my_model.py`. This file itself must keep failing (the harness
checks it). Plain torch only; no function here keeps state, and none may modify its inputs in place.
"""

from __future__ import annotations

import torch

# ---- task 1: RMSNorm ----


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight.

    x (..., size), weight (size,) in x's dtype (as in every model here). Returns x's shape and
    dtype.
    Hints: square and average in float32 (or float64 when x is float64): a bfloat16 sum loses
    too many bits. Cast the normalized x back to x's dtype *before* multiplying by weight, as
    Hugging Face does, so a bfloat16 model rounds the same way.
    """
    raise NotImplementedError("task 1: rms_norm")


# ---- task 2: rotary position embedding (RoPE) ----


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Split the last dimension into halves (x1, x2) and return (-x2, x1).

    x (..., D) with D even. Example: [1, 2, 3, 4] -> [-3, -4, 1, 2].
    """
    raise NotImplementedError("task 2: rotate_half")


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The angular speed of each rotated pair: theta ** (-2i / head_dim) for i in 0..head_dim/2-1.

    Returns (head_dim // 2,) float32. Example: head_dim 4, theta 10000 -> [1.0, 0.01].
    """
    raise NotImplementedError("task 2: rope_inv_freq")


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, pair) angle, each (T, head_dim) in `dtype`.

    positions (T,) integers; inv_freq (head_dim // 2,). angle[t, i] = positions[t] * inv_freq[i],
    and both halves of the last dimension carry the same angles: [angles, angles].
    Hint: compute the angles in float32 and cast cos and sin at the end, as Hugging Face does.
    """
    raise NotImplementedError("task 2: rope_cos_sin")


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, H, D) and k (T, H_kv, D) by their tokens' angles; cos, sin (T, D).

    Each is x * cos + rotate_half(x) * sin, with cos and sin broadcast over the head axis.
    Returns new (q, k) of the same shapes.
    """
    raise NotImplementedError("task 2: apply_rotary")


# ---- task 3: causal grouped-query attention ----


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last Tq positions of one sequence over all Tk of its positions.

    q (Tq, H, D); k, v (Tk, H_kv, D) with Tq <= Tk and H a multiple of H_kv. Query i sits at
    position Tk - Tq + i and sees keys 0 ..= Tk - Tq + i. Query head h reads kv head
    h // (H // H_kv). Returns (Tq, H, D) in q's dtype.
    Hints: scores = q . k * scale; put -inf where a key is in the query's future; softmax over
    the keys in at least float32; weight the values.
    """
    raise NotImplementedError("task 3: attend")


# ---- task 4: the SwiGLU MLP ----


def swiglu(
    x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), where gate(x) = x @ gate_w.T and so on (no biases).

    x (..., hidden); gate_w, up_w (I, hidden); down_w (hidden, I). Returns (..., hidden).
    silu(z) = z * sigmoid(z).
    """
    raise NotImplementedError("task 4: swiglu")


# ---- task 5: top-k and top-p filtering ----


def filter_probs(probs: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Zero every token outside the top-k (a token tied with the k-th stays), then outside the
    smallest set whose mass reaches p.

    probs (V,) non-negative. top_k None keeps all; top_p 1.0 keeps all. Top-p is measured on
    what top-k left (as if renormalized), and the token that crosses p is kept. Returns (V,):
    kept entries keep their relative sizes (renormalizing is allowed, not required).
    """
    raise NotImplementedError("task 5: filter_probs")


# ---- task 6: sampling one token ----


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """One token id drawn from logits (V,).

    temperature 0 (or top_k 1) is greedy: the argmax, no randomness used. Otherwise draw from
    softmax(logits / temperature) after filter_probs, using only `generator` for randomness when
    one is given, so the same seed gives the same tokens whatever else ran in between.
    """
    raise NotImplementedError("task 6: sample")
