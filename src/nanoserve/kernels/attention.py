"""Reference attention in plain torch: causal, grouped-query, one sequence at a time.

Introduced in stage 00; the oracle every attention backend is tested against. Every torch cache
layout (none, slabs, slots, paged blocks) ends up calling `attend` with one sequence's queries and
its whole key/value history, so the arithmetic is the same at every stage and their tokens can be
compared exactly. It is slow and does no tiling.
"""

import itertools

import torch

from nanoserve.layers.norm import reduction_dtype


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last Tq positions of a sequence over all Tk of its positions.

    q (Tq, H, D), k and v (Tk, H_kv, D) with Tq <= Tk: query i sits at position Tk - Tq + i and
    sees keys 0 ..= Tk - Tq + i. Returns (Tq, H, D).
    """
    num_q, num_k = q.shape[0], k.shape[0]
    mask = None
    if num_q > 1:
        q_pos = torch.arange(num_k - num_q, num_k, device=q.device)[:, None]
        mask = torch.arange(num_k, device=q.device)[None, :] > q_pos  # (Tq, Tk): True = hidden
        mask = mask[None]  # a batch of one
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, T, D)
    return grouped_attention(q, k, v, scale, mask)[0].transpose(0, 1)


def attend_decode_padded(q, k, v, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, at its last position, over its padded history.

    q (B, H, D); k and v (B, S, H_kv, D) where row b is valid for its first context_lens[b]
    positions and padding after. Returns (B, H, D). One batched product per kv head reads k and v
    in place, through strides, instead of copying them into a head-major layout first.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # query heads by group
    scores = (
        torch.stack(
            [torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)], dim=1
        )
        * scale
    )  # (B, H_kv, G, S)
    pad = torch.arange(k.shape[1], device=q.device)[None, :] >= context_lens[:, None]  # (B, S)
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=reduction_dtype(q.dtype)).to(q.dtype)
    out = [torch.bmm(probs[:, h], v[:, :, h]) for h in range(num_kv_heads)]  # (B, G, D) each
    return torch.stack(out, dim=1).view(batch, num_heads, head_dim)


def grouped_attention(q, k, v, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v with H / H_kv query heads sharing each kv head.

    q (B, H, Tq, D); k, v (B, H_kv, Tk, D); mask broadcastable to (B, Tq, Tk), True = hidden.
    Query head h uses kv head h // (H / H_kv), so no kv head is ever copied.
    """
    batch, num_heads, num_q, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q = q.reshape(batch, num_kv_heads, group * num_q, head_dim)  # heads of a group side by side
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H_kv, G * Tq, Tk)
    scores = scores.view(batch, num_kv_heads, group, num_q, -1)
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=reduction_dtype(q.dtype)).to(q.dtype)
    out = torch.matmul(probs.view(batch, num_kv_heads, group * num_q, -1), v)
    return out.view(batch, num_heads, num_q, head_dim)


class NoCacheAttention:
    """Stage 00's backend: packed sequences attend only to themselves; nothing is stored.

    Every sequence is fed whole, so its keys are exactly its packed rows: sequences of 3 and 2
    tokens give cu_seqlens_q [0, 3, 5], and rows 0..2 attend over rows 0..2.
    """

    name = "torch"

    def forward(self, layer_id: int, q, k, v, scale: float, metadata) -> torch.Tensor:
        """Attention output for every packed token, (T, H, D)."""
        bounds = metadata.host.cu_seqlens_q
        return torch.cat(
            [attend(q[s:e], k[s:e], v[s:e], scale) for s, e in itertools.pairwise(bounds)]
        )
